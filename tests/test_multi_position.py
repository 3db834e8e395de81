"""The data path's speculative seam, proved with a fixed-draft proposer: requests verify K draft
tokens in one step (logits at 1 + K positions, one sampler call), rejected drafts give their KV
slots back, and greedy outputs and logprobs equal the step-by-step engine's."""
from __future__ import annotations

import numpy as np
import pytest

from llmkit import LLM, SamplingParams
from llmkit.spec_decode.base import Proposer

MAX_TOKENS = 24
PROMPTS = [[5, 9, 33, 2, 71, 8], [17] * 20, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


class OracleProposer(Proposer):
    """Proposes the next K tokens of a known continuation, deliberately wrong wherever the
    drafted position is in ``wrong_at`` (position = index in the output), and counts what it
    proposed."""

    def __init__(self, continuations: dict[tuple, list[int]], k: int, wrong_at: set[int],
                 vocab: int) -> None:
        self.continuations, self.num_speculative_tokens = continuations, k
        self.wrong_at, self.vocab = wrong_at, vocab
        self.proposed = 0
        self.checks: list = []

    def propose(self, batch, rows: np.ndarray, step=None) -> dict[str, list[int]]:
        drafts = {}
        for row in rows.tolist():
            n_prompt = int(batch.num_prompt_tokens[row])
            ref = self.continuations[tuple(batch.token_ids[row, :n_prompt].tolist())]
            done = int(batch.num_tokens[row]) - n_prompt
            d = []
            for pos in range(done, min(done + self.num_speculative_tokens, len(ref))):
                d.append((ref[pos] + 1) % self.vocab if pos in self.wrong_at else ref[pos])
            if d:
                drafts[batch.req_ids[row]] = d
                self.proposed += len(d)
        for check in self.checks:
            check()
        return drafts


def run(model_dir, params: SamplingParams, proposer=None, **groups):
    llm = LLM(str(model_dir), dtype="float32", **groups)
    if proposer is not None:
        llm.engine.executor.runner.proposer = proposer
        kv = llm.engine.kv_cache_manager
        proposer.checks.append(kv.check_integrity)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every block back, rejected slots included
    return llm, outs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    _, outs = run(model_dir, params)
    return params, outs


@pytest.mark.parametrize("k,wrong_at", [(3, set()), (4, {2, 3, 9, 15}), (2, set(range(0, 99, 2)))],
                         ids=["all-accepted", "some-wrong", "every-other-wrong"])
def test_verified_drafts_give_the_step_by_step_tokens_and_logprobs(model_dir, reference, k,
                                                                   wrong_at):
    params, ref = reference
    continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    proposer = OracleProposer(continuations, k, wrong_at, vocab=640)
    llm, outs = run(model_dir, params, proposer)
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        # Logits at the verified positions equal one-position-at-a-time logits.
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert lp_got.keys() == lp_want.keys()
            for t in lp_got:
                assert abs(lp_got[t].logprob - lp_want[t].logprob) < 1e-4
    stats = llm.engine.stats().spec_decode
    # drafts past max_tokens (or of a request that just finished) are never scheduled
    assert 0 < stats.num_draft_tokens <= proposer.proposed
    if not wrong_at:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        # steps: each verify step yields K + 1 tokens
        assert stats.mean_acceptance_length == pytest.approx(
            1 + stats.num_accepted_tokens / stats.num_drafts)
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_drafts_under_preemption_and_chunked_prefill(model_dir, reference):
    """A pool too small for all three requests (preemption and recompute) and a small token
    budget (prompts in chunks, drafts cut to the budget): the same tokens."""
    params, ref = reference
    continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    proposer = OracleProposer(continuations, 3, {4, 10}, vocab=640)
    llm, outs = run(model_dir, params, proposer, kv_cache={"num_blocks": 14, "block_size": 4},
                    scheduler={"max_num_batched_tokens": 8})
    assert llm.engine.stats().num_preemptions_total > 0
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_stop_token_inside_an_accepted_run_ends_it(model_dir, reference):
    params, ref = reference
    continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    first = ref[0].outputs[0].token_ids
    stop = first[5]
    want = first[:first.index(stop) + 1]
    proposer = OracleProposer(continuations, 4, set(), vocab=640)
    _, outs = run(model_dir, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            ignore_eos=True, stop_token_ids=[stop]), proposer)
    assert outs[0].outputs[0].token_ids == want
    assert outs[0].outputs[0].finish_reason == "stop"
    # max_tokens inside a run: cut there
    _, outs = run(model_dir, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                  OracleProposer(continuations, 4, set(), vocab=640))
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 7, 7]


def test_shrink_slots_gives_back_the_tail_and_keeps_cached_blocks():
    from llmkit.kv_cache import KVCacheManager
    from llmkit.request import Request

    kv = KVCacheManager(num_blocks=16, block_size=4)
    req = Request("r", list(range(10)), SamplingParams(max_tokens=8))
    blocks, hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 10, 6, new_computed_blocks=blocks,
                             num_new_computed_tokens=hit) is not None
    assert len(kv.get_blocks("r")) == 4  # 16 slots: 10 tokens + 6 lookahead
    cached = [b.block_id for b in kv.get_blocks("r") if b.block_hash is not None]
    assert len(cached) == 2  # two full blocks of known tokens
    assert kv.shrink_slots(req, 9) == 1
    assert len(kv.get_blocks("r")) == 3 and kv.num_free_blocks == 13
    assert [b.block_id for b in kv.get_blocks("r")][:2] == cached
    kv.check_integrity()
    assert kv.shrink_slots(req, 12) == 0  # nothing past 12 tokens' three blocks
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_constrained_greedy_is_the_same_with_drafts(model_dir):
    """Drafts verified under a grammar: each verified position gets its own bitmask row (the
    grammar advanced through the drafts before it), so a draft the grammar refuses is rejected
    and the output equals the constrained output without drafts."""
    from llmkit import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=(
        StructuredOutputsParams(regex=r"(the |a |dog |cat ){2,12}")))
    _, want = run(model_dir, params)
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _, unconstrained = run(model_dir, free)
    # Drafts from the constrained outputs (wrong at known positions) and from the
    # unconstrained ones (mostly refused by the grammar).
    for source, wrong in ((want, {1, 4, 7}), (unconstrained, set())):
        continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, source)}
        llm, got = run(model_dir, params, OracleProposer(continuations, 3, wrong, vocab=640))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0
