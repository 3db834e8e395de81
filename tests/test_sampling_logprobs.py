"""Logprobs and prompt logprobs end to end, against a float32 log_softmax of HF's logits."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmkit import LLM, SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (37, 9, 21)]
    llm = LLM(str(model_dir), dtype="float32", kv_cache={"block_size": 8})
    return model_dir, hf, llm, prompts


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_logprobs_match_hf(setup):
    _, hf, llm, prompts = setup
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=2,
                             ignore_eos=True, repetition_penalty=1.3, top_k=20),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        c = out.outputs[0]
        if sp.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
            continue
        ref = hf_logprobs(hf, prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for j, tok in enumerate(c.token_ids):
            # Raw distribution: before penalties, top-k and temperature (vLLM's default).
            row = ref[len(prompt) - 1 + j]
            d = c.logprobs[j]
            assert abs(d[tok].logprob - row[tok].item()) < TOL
            assert d[tok].rank == int((row >= row[tok]).sum())
            top = row.topk(sp.logprobs)
            for r, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert abs(d[t].logprob - lp) < TOL and d[t].rank == r
            assert set(d) <= set(top.indices.tolist()) | {tok}
            assert d[tok].decoded_token == llm.get_tokenizer().decode([tok])
            total += d[tok].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)
    assert_blocks_free(llm)


def test_logprobs_zero_returns_the_sampled_token_only(setup):
    _, _, llm, prompts = setup
    c = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                     use_tqdm=False)[0].outputs[0]
    assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]


def check_prompt_logprobs(hf, prompt: list[int], got, k: int) -> None:
    ref = hf_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, d = ref[j - 1], got[j]
        assert abs(d[prompt[j]].logprob - row[prompt[j]].item()) < TOL
        assert d[prompt[j]].rank == int((row >= row[prompt[j]]).sum())
        top = row.topk(k)
        for lp, t in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(d[t].logprob - lp) < TOL


def test_prompt_logprobs_match_hf_and_skip_the_prefix_cache(setup):
    _, hf, llm, prompts = setup
    prompt = prompts[0]  # 37 tokens = 4 full blocks of 8
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    # Its prompt is cached, but cached positions have no logits: no hit, no lookup.
    assert out.num_cached_tokens == 0
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits == stats.hits
    check_prompt_logprobs(hf, prompt, out.prompt_logprobs, 3)
    # Its own blocks are cached for others.
    fresh = prompts[2] + prompts[1]
    llm.generate([fresh], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    again = llm.generate([fresh], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 24
    assert_blocks_free(llm)


def test_prompt_logprobs_accumulate_across_chunks_and_preemption(setup):
    model_dir, hf, _, prompts = setup
    # 8-token chunks; 14 blocks of 4 tokens for 3 requests of up to 49 tokens: preemptions.
    llm = LLM(str(model_dir), dtype="float32", scheduler={"max_num_batched_tokens": 8},
              kv_cache={"block_size": 4, "num_blocks": 14})
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(hf, prompt, out.prompt_logprobs, 2)
    assert_blocks_free(llm)


def test_prompt_logprobs_of_a_one_token_prompt(setup):
    _, _, llm, _ = setup
    out = llm.generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert out[0].prompt_logprobs == [None]


def test_streamed_logprobs_arrive_with_their_tokens(setup):
    _, _, llm, prompts = setup
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=1,
                        ignore_eos=True)
    final = llm.generate([prompts[2]], sp, use_tqdm=False)[0]
    deltas = list(llm.stream(prompts[2], sp))
    assert [d for o in deltas for d in o.outputs[0].logprobs] == final.outputs[0].logprobs
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in deltas[1:])
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(
        final.outputs[0].cumulative_logprob)
