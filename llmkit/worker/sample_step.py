"""A step's sampling: logits at the rows that sample (``LogitsLayout``), the sampler, and the
new tokens written into the persistent batch; with speculative decoding, the draft
distributions the verifier compares against and the acceptance adaptive K learns from.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from llmkit.outputs import LogprobsLists
from llmkit.sampling.sampler import SamplerOutput
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode.base import Proposer
from llmkit.worker.input_batch import InputBatch
from llmkit.worker.sampling_inputs import (LogitsLayout, build_sampling_metadata,
                                          record_sampled_tokens)
from llmkit.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from llmkit.worker.model_runner import ModelRunner

__all__ = ["sample_step"]


def sample_step(runner: ModelRunner, so: SchedulerOutput, inputs: StepInputs,
                hidden: torch.Tensor
                ) -> tuple[dict[int, list[int]], dict[str, LogprobsLists]]:
    """The tokens sampled per batch row (recorded in the batch), and the logprobs of the
    requests that asked for them."""
    logprobs: dict[str, LogprobsLists] = {}
    layout = inputs.logits
    if not len(layout.rows):
        return {}, logprobs
    batch, proposer, device = runner.batch, runner.proposer, runner.device
    idx = inputs.logits_indices
    # Every token samples (a decode step): the logits positions are 0..n-1, the hidden states
    # as they are (advanced indexing would copy them).
    at = hidden if len(idx) == hidden.shape[0] else hidden[idx.to(device)]
    logits = runner.model.compute_logits(at)
    bitmask_rows = None
    if so.grammar_bitmask is not None:
        bitmask_rows = _bitmask_rows(so)
    meta = build_sampling_metadata(batch, layout, logits.shape[-1], device, bitmask_rows,
                                   so.grammar_bitmask)
    if meta.spec is not None and proposer is not None:
        meta.spec.draft_probs = _draft_probs(proposer, batch, layout, logits.shape[-1], device)
    out = runner.sampler.sample(logits.float(), meta)
    sampled_by_row = _record(batch, layout, out, logprobs, runner.max_model_len)
    if so.scheduled_spec_tokens and proposer is not None and proposer.observes_acceptance:
        _observe_acceptance(proposer, batch, so.scheduled_spec_tokens, sampled_by_row)
    return sampled_by_row, logprobs


def _bitmask_rows(so: SchedulerOutput) -> dict[str, int]:
    """Each constrained request's first bitmask row (1 + its drafts rows each)."""
    rows, start = {}, 0
    for rid in so.structured_output_request_ids:
        rows[rid] = start
        start += 1 + len(so.scheduled_spec_tokens.get(rid, ()))
    return rows


def _draft_probs(proposer: Proposer, batch: InputBatch, layout: LogitsLayout, vocab_size: int,
                 device: torch.device) -> torch.Tensor | None:
    """q per logits row when the proposer drew its drafts from a distribution (one-hot rows
    for drafts given as tokens, zero rows for bonus positions); None if it never did."""
    probs = [proposer.draft_probs(batch.req_ids[r], d) if d else None
             for r, d in zip(layout.rows.tolist(), layout.drafts)]
    if all(p is None for p in probs):
        return None
    q = torch.zeros(int(layout.num_logits.sum()), vocab_size, device=device)
    start = 0
    for p, d, n in zip(probs, layout.drafts, layout.num_logits.tolist()):
        if p is not None:
            q[start:start + len(d)] = p
        elif d:
            q[torch.arange(start, start + len(d), device=device),
              torch.tensor(d, device=device)] = 1.0
        start += n
    return q


def _record(b: InputBatch, layout: LogitsLayout, out: SamplerOutput,
            logprobs: dict[str, LogprobsLists], max_model_len: int) -> dict[int, list[int]]:
    """Append the new tokens to the batch; collect logprobs of rows that asked."""
    rows = layout.rows
    row_list = rows.tolist()
    if out.output_token_ids is not None:
        tokens = out.output_token_ids
    else:
        tokens = [[t] for t in out.sampled_token_ids.tolist()]
    for row, toks in zip(row_list, tokens):
        n = b.num_tokens[row]
        end = min(n + len(toks), max_model_len)
        b.token_ids[row, n:end] = toks[:end - n]
        b.num_tokens[row] = n + len(toks)
    record_sampled_tokens(b, rows, tokens)
    if out.logprobs is not None:
        num_lp = b.num_logprobs[rows]
        lists = out.logprobs.to_lists()
        starts = np.cumsum(layout.num_logits) - layout.num_logits
        for i in np.flatnonzero(num_lp >= 0).tolist():
            k = int(num_lp[i]) + 1  # rows were computed with the batch's largest k
            s0, n = int(starts[i]), len(tokens[i])
            logprobs[b.req_ids[row_list[i]]] = LogprobsLists(
                [ids[:k] for ids in lists.token_ids[s0:s0 + n]],
                [lps[:k] for lps in lists.logprobs[s0:s0 + n]], lists.ranks[s0:s0 + n])
    return dict(zip(row_list, tokens))


def _observe_acceptance(proposer: Proposer, batch: InputBatch,
                        spec_tokens: dict[str, list[int]],
                        sampled_by_row: dict[int, list[int]]) -> None:
    """Drafts and accepted drafts of each verified row, for adaptive K's estimate."""
    req_ids = batch.req_ids
    drafted, accepted = [], []
    for row, tokens in sampled_by_row.items():
        drafts = spec_tokens.get(req_ids[row])
        if drafts:
            drafted.append(len(drafts))
            accepted.append(len(tokens) - 1)
    if drafted:
        proposer.observe_acceptance(np.array(drafted), np.array(accepted))
