"""n > 1: n independent samples of one prompt, prefilled once, gathered into one output."""
from __future__ import annotations

import random

import pytest

from llmkit import LLM, SamplingParams

BLOCK = 8


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache={"block_size": BLOCK})


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def assert_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_n_samples_share_the_prefill(llm):
    p = prompt(45, 1)  # (45 - 1) // 8 = 5 full blocks may be shared
    kv = llm.engine.kv_cache_manager
    before = kv.prefix_cache_stats
    out = llm.generate([p], SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3),
                       use_tqdm=False)[0]
    after = kv.prefix_cache_stats
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.finished and all(c.finish_reason is not None for c in out.outputs)
    # The first child computes the prompt; the 3 others hit its 5 full blocks, admitted in
    # the same step (the prompt's KV is computed once).
    assert after.hits - before.hits == 3 * 5 * BLOCK
    assert after.queries - before.queries == 4 * len(p)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    assert_blocks_free(llm)


def test_children_seeds_are_seed_plus_index(llm):
    p = prompt(20, 2)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=100, ignore_eos=True)
    out = llm.generate([p], sp, use_tqdm=False)[0]
    again = llm.generate([p], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    for i, c in enumerate(out.outputs):
        single = llm.generate([p], SamplingParams(temperature=1.0, max_tokens=8, seed=100 + i,
                                                  ignore_eos=True), use_tqdm=False)[0]
        assert single.outputs[0].token_ids == c.token_ids


def test_greedy_n_gives_n_identical_completions_and_mixes_with_other_prompts(llm):
    p, q = prompt(30, 3), prompt(12, 4)
    outs = llm.generate([p, q], [SamplingParams(n=3, temperature=0, max_tokens=5),
                                 SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert len(outs) == 2 and len(outs[0].outputs) == 3 and len(outs[1].outputs) == 1
    alone = llm.generate([p], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert all(c.token_ids == alone.outputs[0].token_ids for c in outs[0].outputs)
    assert all(c.text == alone.outputs[0].text for c in outs[0].outputs)


def test_n_with_prompt_logprobs_and_logprobs(llm):
    p = prompt(33, 5)
    out = llm.generate([p], SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=4,
                                           logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert c.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_streaming_n_and_abort(llm):
    p = prompt(25, 6)
    sp = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
    final = llm.generate([p], sp, use_tqdm=False)[0]
    texts, ids = {}, {}
    for out in llm.stream(p, sp):
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
    assert out.finished
    assert [ids[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert [texts[i] for i in range(3)] == [c.text for c in final.outputs]
    # Abandoning a stream aborts every sample.
    stream = llm.stream(p, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert_blocks_free(llm)
