"""Logits processors over the persistent batch: penalties against HF's and OpenAI's formulas,
logit bias as plain addition, allowed ids, bad words, min_tokens, the external mask — and the
fast paths that skip all of it when no row needs it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from llmkit.sampling import SamplingParams, TorchSampler
from llmkit.sampling.logits_processors import apply_penalties, apply_token_constraints
from llmkit.sampling.sampler import PenaltyInputs
from llmkit.scheduler.base import NewRequestData
from llmkit.worker.input_batch import InputBatch
from llmkit.worker.sample_step import (LogitsLayout, build_sampling_metadata,
                                          record_sampled_tokens)

V = 50
EOS = 2
CPU = torch.device("cpu")


def make_batch(rows: list[tuple[list[int], list[int], SamplingParams]]) -> InputBatch:
    """A persistent batch holding each (prompt, output so far, params) as one row."""
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_blocks_per_req=4)
    for i, (prompt, output, sp) in enumerate(rows):
        batch.add_request(NewRequestData(f"r{i}", prompt + output, len(prompt), sp, [], 0,
                                         eos_token_id=EOS), None)
    return batch


def pack_masks(masks: list[torch.Tensor]) -> np.ndarray:
    """bool [V] masks -> xgrammar's int32 bitmask rows (bit i of word j = token 32 j + i)."""
    words = -(-V // 32)
    out = np.zeros((len(masks), words), dtype=np.uint32)
    for r, m in enumerate(masks):
        for t in m.nonzero().flatten().tolist():
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def processed(batch: InputBatch, logits: torch.Tensor, token_masks=None) -> torch.Tensor:
    """The constraints and penalties of a step; ``token_masks`` {req_id: bool [V]} travel as
    the scheduler sends them: a packed grammar bitmask, one row per constrained request."""
    rows = {}
    bitmask = None
    if token_masks:
        rows = {rid: i for i, rid in enumerate(token_masks)}
        bitmask = pack_masks(list(token_masks.values()))
    meta = build_sampling_metadata(batch, LogitsLayout.one_each(np.arange(batch.num_reqs)), V,
                                   CPU, rows, bitmask)
    out = logits.clone()
    apply_token_constraints(out, meta)
    if meta.penalties is not None:
        apply_penalties(out, meta.penalties)
    return out


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, V, generator=g) * 3  # positive and negative logits


PROMPT = [5, 6, 7, 7, 30]
OUTPUT = [7, 8, 8, 8, 31, 5]


def openai_penalties(row: torch.Tensor, output: list[int], frequency: float,
                     presence: float) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * alpha_frequency - (c[j] > 0) *
    alpha_presence, with c[j] the count of token j in the generated text so far."""
    out = row.clone()
    for j in range(V):
        c = output.count(j)
        out[j] = row[j] - c * frequency - float(c > 0) * presence
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(logits, penalty):
    batch = make_batch([(PROMPT, OUTPUT, SamplingParams(repetition_penalty=penalty)),
                        (PROMPT, OUTPUT, SamplingParams())])
    got = processed(batch, logits[:2])
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]),
                                                  logits[:1].clone())
    torch.testing.assert_close(got[0], hf[0], rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # a row without penalties is untouched


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.2), (0.8, -0.4),
                                                (-1.0, 2.0)])
def test_presence_and_frequency_match_openai(logits, frequency, presence):
    sp = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    got = processed(make_batch([(PROMPT, OUTPUT, sp)]), logits[:1])
    # Prompt tokens do not count (token 6 is only in the prompt).
    torch.testing.assert_close(got[0], openai_penalties(logits[0], OUTPUT, frequency, presence),
                               rtol=0, atol=1e-6)


def test_all_penalties_together_in_vllms_order(logits):
    sp = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    got = processed(make_batch([(PROMPT, OUTPUT, sp)]), logits[:1])
    rep = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([PROMPT + OUTPUT]),
                                                logits[:1].clone())[0]
    torch.testing.assert_close(got[0], openai_penalties(rep, OUTPUT, 0.3, 0.2), rtol=0,
                               atol=1e-6)


def test_dense_penalty_inputs_equal_the_runners_sparse_ones(logits):
    sp = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    got = processed(make_batch([(PROMPT, OUTPUT, sp)]), logits[:1])
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).to(torch.int32)[None]
    prompt_mask = (torch.bincount(torch.tensor(PROMPT), minlength=V) > 0)[None]
    pen = PenaltyInputs.from_dense(torch.tensor([0]), torch.tensor([0.2]), torch.tensor([0.3]),
                                   torch.tensor([1.5]), counts, prompt_mask)
    dense = logits[:1].clone()
    apply_penalties(dense, pen)
    torch.testing.assert_close(dense, got, rtol=0, atol=1e-6)


def test_logit_bias_is_plain_addition(logits):
    bias = {3: 5.0, 11: -2.5, 49: 100.0}
    batch = make_batch([(PROMPT, OUTPUT, SamplingParams(logit_bias=bias)),
                        (PROMPT, [], SamplingParams())])
    got = processed(batch, logits[:2])
    want = logits[0].clone()
    for t, b in bias.items():
        want[t] += b
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    assert torch.equal(got[1], logits[1])


def test_penalty_counts_follow_sampled_tokens(logits):
    sp = SamplingParams(frequency_penalty=1.0)
    batch = make_batch([(PROMPT, [], sp), (PROMPT, [], SamplingParams())])
    rows = np.arange(2)
    assert torch.equal(processed(batch, logits[:2]), logits[:2])  # no output yet
    for tok in (9, 9, 4):
        # As the runner does after sampling: record the token, append it to the row.
        record_sampled_tokens(batch, rows, [[tok], [tok]])
        for r in rows:
            batch.token_ids[r, batch.num_tokens[r]] = tok
            batch.num_tokens[r] += 1
    got = processed(batch, logits[:2])
    torch.testing.assert_close(got[0], openai_penalties(logits[0], [9, 9, 4], 1.0, 0.0),
                               rtol=0, atol=1e-6)
    # A fresh build from the token row (as after preemption) gives the same counts.
    batch.extras[0].penalty = None
    torch.testing.assert_close(processed(batch, logits[:2]), got, rtol=0, atol=0)


def test_allowed_ids_and_external_mask(logits):
    batch = make_batch([(PROMPT, [], SamplingParams(allowed_token_ids=[4, 9, 20])),
                        (PROMPT, [], SamplingParams()),
                        (PROMPT, [], SamplingParams(allowed_token_ids=[4, 9]))])
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[9, 10, 20]] = True
    got = processed(batch, logits[:3], {"r0": mask, "r1": mask})
    finite = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in got]
    assert finite == [{9, 20}, {9, 10, 20}, {4, 9}]
    assert torch.equal(got[0, [9, 20]], logits[0, [9, 20]])


def test_min_tokens_masks_eos_and_stop_ids_until_reached(logits):
    sp = SamplingParams(min_tokens=3, stop_token_ids=[17])
    batch = make_batch([(PROMPT, [1, 2], sp), (PROMPT, [1, 1, 1], sp),
                        (PROMPT, [], SamplingParams(stop_token_ids=[17]))])
    got = processed(batch, logits[:3])
    assert torch.isinf(got[0, [EOS, 17]]).all()  # 2 outputs < 3
    assert torch.isfinite(got[0]).sum() == V - 2
    assert torch.equal(got[1], logits[1]) and torch.equal(got[2], logits[2])


def test_bad_words_ban_the_completing_token(logits):
    sp = SamplingParams(bad_words=["x"], bad_words_token_ids=[[40], [12, 13, 14]])
    batch = make_batch([(PROMPT, [3, 12, 13], sp), (PROMPT, [12, 3], sp)])
    got = processed(batch, logits[:2])
    assert torch.isinf(got[0, [40, 14]]).all() and torch.isfinite(got[0]).sum() == V - 2
    assert torch.isinf(got[1, 40]) and torch.isfinite(got[1]).sum() == V - 1


def test_greedy_sampling_uses_processed_logits(logits):
    row = logits[0].clone()
    top = int(row.argmax())
    sp = SamplingParams(temperature=0.0, logit_bias={top: -100.0})
    batch = make_batch([(PROMPT, [], sp), (PROMPT, [], SamplingParams(temperature=0.0))])
    meta = build_sampling_metadata(batch, LogitsLayout.one_each(np.arange(2)), V, CPU)
    tokens = TorchSampler()(logits[:2], meta)
    assert int(tokens[0]) == int(processed(batch, logits[:2])[0].argmax()) != top
    assert int(tokens[1]) == int(logits[1].argmax())


def test_plain_batches_skip_every_processing_step(logits, monkeypatch):
    batch = make_batch([(PROMPT, OUTPUT, SamplingParams(temperature=0.0))] * 3
                       + [(PROMPT, OUTPUT, SamplingParams(temperature=0.8))])
    greedy = build_sampling_metadata(batch, LogitsLayout.one_each(np.arange(3)), V, CPU)
    assert greedy.all_greedy and not greedy.has_processors
    assert (greedy.top_k, greedy.top_p, greedy.min_p, greedy.max_num_logprobs) == (None,) * 4
    sampler = TorchSampler()

    def boom(*args, **kwargs):
        raise AssertionError("a greedy-only batch took the random path")

    monkeypatch.setattr(sampler, "_sample_mixed", boom)
    assert torch.equal(sampler(logits[:3], greedy), logits[:3].argmax(-1))
    mixed = build_sampling_metadata(batch, LogitsLayout.one_each(np.arange(4)), V, CPU)
    assert not mixed.all_greedy and not mixed.has_processors
    assert (mixed.top_k, mixed.top_p, mixed.min_p) == (None,) * 3  # nobody filters
    # top-k / top-p / min-p of greedy rows do not turn the filters on.
    batch2 = make_batch([(PROMPT, [], SamplingParams(temperature=0.0, top_k=5, top_p=0.5)),
                         (PROMPT, [], SamplingParams(temperature=1.0))])
    meta2 = build_sampling_metadata(batch2, LogitsLayout.one_each(np.arange(2)), V, CPU)
    assert (meta2.top_k, meta2.top_p) == (None, None)


def test_sampler_never_modifies_its_input(logits):
    batch = make_batch([(PROMPT, OUTPUT, SamplingParams(repetition_penalty=1.4, top_k=3,
                                                        logit_bias={1: 2.0}, logprobs=2))])
    meta = build_sampling_metadata(batch, LogitsLayout.one_each(np.arange(1)), V, CPU)
    before = logits[:1].clone()
    out = TorchSampler().sample(logits[:1], meta)
    assert torch.equal(logits[:1], before)
    # Logprobs come from the raw logits (before penalties, bias and top-k).
    raw = before.log_softmax(-1)
    tok = int(out.sampled_token_ids[0])
    assert out.logprobs.token_ids[0, 0] == tok
    torch.testing.assert_close(out.logprobs.logprobs[0, 0], raw[0, tok])
    torch.testing.assert_close(out.logprobs.logprobs[0, 1:], raw[0].topk(2).values)
    assert int(out.logprobs.ranks[0]) == int((raw[0] >= raw[0, tok]).sum())
