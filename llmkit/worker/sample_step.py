"""A step's sampling: logits at the rows that sample (``LogitsLayout``), the sampler, and the
new tokens written into the persistent batch; with speculative decoding, the draft
distributions the verifier compares against and the acceptance adaptive K learns from.

The sampler's inputs (``build_sampling_metadata``) come from the persistent batch, one row per
logits position. A request samples at one position (its next token), or at 1 + K when it
verifies K draft tokens: logits row ``(request, j)`` sees the request's tokens plus its first
``j`` drafts, so penalties, bad words and ``min_tokens`` are applied with that position's own
history. Every part of :class:`SamplingMetadata` is built only when a row of this step needs
it: the per-request numpy columns answer "does any row need X" with one vectorised check, and a
batch of plain greedy rows costs a temperature slice and nothing more. Ragged data (bias,
allow-lists, bad words, min_tokens stop ids) is gathered by a Python loop over the rows that
have it only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmkit.outputs import LogprobsLists
from llmkit.sampling.bad_words import banned_next_tokens
from llmkit.sampling.params import is_random
from llmkit.sampling.sampler import (PenaltyInputs, SamplerOutput, SamplingMetadata,
                                    SpecDecodeMetadata)
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode.base import Proposer
from llmkit.worker.input_batch import (GrowingIds, InputBatch, LogitsLayout, PenaltyState,
                                       StepInputs)

if TYPE_CHECKING:
    from llmkit.worker.model_runner import ModelRunner

__all__ = ["build_sampling_metadata", "record_sampled_tokens", "sample_step"]


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


# -- the sampler's inputs, from the persistent batch ---------------------------------------
def build_sampling_metadata(batch: InputBatch, layout: LogitsLayout, vocab_size: int,
                            device: torch.device, req_bitmask_rows: dict[str, int] | None = None,
                            grammar_bitmask: np.ndarray | None = None) -> SamplingMetadata:
    """Metadata for the step's logits rows (``layout``). ``req_bitmask_rows`` maps a
    constrained request to its first row of ``grammar_bitmask`` (one row per logits
    position)."""
    drafts = layout.has_drafts
    lrows = layout.logits_rows if drafts else layout.rows
    offsets = layout.offsets if drafts else None
    temperature = batch.temperature[lrows]
    random = is_random(temperature)
    any_random = bool(random.any())
    top_k = top_p = min_p = None
    generators: dict[int, torch.Generator] = {}
    if any_random:
        # Filters are only built when a random row uses them (greedy rows ignore them).
        k, p, mp = batch.top_k[lrows], batch.top_p[lrows], batch.min_p[lrows]
        if ((k[random] > 0) & (k[random] < vocab_size)).any():
            top_k = _tensor(k, device)
        if (p[random] < 1.0).any():
            top_p = _tensor(p, device)
        if (mp[random] > 0.0).any():
            min_p = _tensor(mp, device)
        for i in np.flatnonzero(batch.has_seed[lrows] & random).tolist():
            generators[i] = batch.generators[lrows[i]]
    num_lp = batch.num_logprobs[lrows]
    max_lp = int(num_lp.max())
    history = _DraftHistory(layout, offsets)
    spec = None
    if offsets is not None:
        draft_ids = np.full(len(lrows), -1, dtype=np.int64)
        for i, d in enumerate(layout.drafts):
            if d:
                start = int(history.starts[i])
                draft_ids[start:start + len(d)] = d
        spec = SpecDecodeMetadata(draft_token_ids=_tensor(draft_ids, device),
                                  num_logits=layout.num_logits.tolist())
    # Rows with no logits processor at all (the common case) need none of the four below.
    processors = bool(batch.has_processors[lrows].any())
    return SamplingMetadata(
        temperature=_tensor(temperature, device),
        all_greedy=not any_random,
        top_k=top_k, top_p=top_p, min_p=min_p,
        generators=generators,
        grammar_bitmask=_grammar_bitmask(batch, layout, req_bitmask_rows, grammar_bitmask,
                                         vocab_size, device),
        allowed_token_ids=_allowed(batch, lrows, device) if processors else None,
        banned_token_ids=_banned(batch, lrows, history, device) if processors else None,
        logit_bias=_bias(batch, lrows, device) if processors else None,
        penalties=_penalties(batch, lrows, history, device) if processors else None,
        max_num_logprobs=max_lp if max_lp >= 0 else None,
        spec=spec,
    )


class _DraftHistory:
    """The draft tokens that precede each logits row (empty without drafts)."""

    def __init__(self, layout: LogitsLayout, offsets: np.ndarray | None) -> None:
        self.layout, self.offsets = layout, offsets
        if offsets is None:  # no drafts: nothing precedes any row
            self.starts = self._owner = None
            return
        self.starts = np.cumsum(layout.num_logits) - layout.num_logits
        self._owner = np.repeat(np.arange(len(layout.rows)), layout.num_logits)

    def before(self, logits_row: int) -> list[int]:
        if self.offsets is None:
            return []
        j = int(self.offsets[logits_row])
        return self.layout.drafts[int(self._owner[logits_row])][:j] if j else []

    def offset(self, logits_row: int) -> int:
        return 0 if self.offsets is None else int(self.offsets[logits_row])


def record_sampled_tokens(batch: InputBatch, rows: np.ndarray, tokens: list[list[int]]) -> None:
    """Keep penalty counts current: the rows' new tokens join their outputs."""
    for i in np.flatnonzero(batch.has_penalties[rows]).tolist():
        state = batch.extras[rows[i]].penalty
        if state is not None:
            for tok in tokens[i]:
                state.add(tok)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _pairs(row_idx: list[int], ids: list[np.ndarray], device: torch.device,
           values: list[np.ndarray] | None = None) -> tuple[torch.Tensor, ...] | None:
    if not row_idx:
        return None
    lengths = [len(a) for a in ids]
    r = np.repeat(np.asarray(row_idx, dtype=np.int64), lengths)
    out = [_tensor(r, device), _tensor(np.concatenate(ids).astype(np.int64), device)]
    if values is not None:
        out.append(_tensor(np.concatenate(values).astype(np.float32), device))
    return tuple(out)


def _grammar_bitmask(batch: InputBatch, layout: LogitsLayout, req_rows: dict[str, int] | None,
                     bitmask: np.ndarray | None, vocab_size: int,
                     device: torch.device) -> torch.Tensor | None:
    """The structured-output seam: the scheduler's bitmask rows of the constrained requests
    placed at their logits rows (unconstrained rows allow everything), packed int32
    ``[logits rows, ceil(V / 32)]``; tokens past the grammar's vocabulary are refused."""
    if bitmask is None or not req_rows:
        return None
    src, dst = [], []
    start = 0
    for row, n in zip(layout.rows.tolist(), layout.num_logits.tolist()):
        first = req_rows.get(batch.req_ids[row])
        if first is not None:
            src.extend(range(first, first + n))
            dst.extend(range(start, start + n))
        start += n
    if not src:
        return None
    words = -(-vocab_size // 32)
    out = np.full((start, words), -1, dtype=np.int32)
    out[dst] = 0
    width = min(words, bitmask.shape[1])
    out[dst, :width] = bitmask[src, :width]
    return torch.from_numpy(out).to(device)


def _allowed(batch: InputBatch, lrows: np.ndarray,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    idx = np.flatnonzero(batch.has_allowed[lrows]).tolist()
    return _pairs(idx, [batch.extras[lrows[i]].allowed_ids for i in idx], device)


def _bias(batch: InputBatch, lrows: np.ndarray, device: torch.device):
    idx = np.flatnonzero(batch.has_bias[lrows]).tolist()
    extras = [batch.extras[lrows[i]] for i in idx]
    return _pairs(idx, [e.bias_ids for e in extras], device, [e.bias_values for e in extras])


def _banned(batch: InputBatch, lrows: np.ndarray, history: _DraftHistory,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bad words completed by the next token, and EOS / stop ids while below min_tokens,
    each with the logits row's own history (its request's output plus earlier drafts)."""
    row_idx: list[int] = []
    ids: list[np.ndarray] = []
    for i in np.flatnonzero(batch.has_bad_words[lrows]).tolist():
        r = lrows[i]
        output = batch.output_token_ids(r).tolist() + history.before(i)
        banned = banned_next_tokens(batch.extras[r].bad_words, output)
        if banned:
            row_idx.append(i)
            ids.append(np.asarray(banned, dtype=np.int64))
    num_out = batch.num_tokens[lrows] - batch.num_prompt_tokens[lrows]
    if history.offsets is not None:
        num_out = num_out + history.offsets
    for i in np.flatnonzero(num_out < batch.min_tokens[lrows]).tolist():
        stop_ids = batch.extras[lrows[i]].min_tokens_stop_ids
        if len(stop_ids):
            row_idx.append(i)
            ids.append(stop_ids)
    return _pairs(row_idx, ids, device)


def _penalties(batch: InputBatch, lrows: np.ndarray, history: _DraftHistory,
               device: torch.device) -> PenaltyInputs | None:
    idx = np.flatnonzero(batch.has_penalties[lrows])
    if not len(idx):
        return None
    pen_rows = lrows[idx]
    states = [_penalty_state(batch, int(r)) for r in pen_rows]
    # A logits row past its request's first position also counts the drafts before it.
    views = [_with_drafts(s, history.before(int(i))) for s, i in zip(states, idx.tolist())]
    pen = PenaltyInputs()
    rep = batch.repetition_penalty[pen_rows]
    sel = [k for k, v in enumerate(views) if v.seen_ids is not None]
    if sel:
        lens = [len(views[k].seen_ids) for k in sel]
        pen.rep_rows = _tensor(np.repeat(idx[sel], lens), device)
        pen.rep_ids = _tensor(np.concatenate([views[k].seen_ids for k in sel]), device)
        pen.rep_penalty = _tensor(np.repeat(rep[sel], lens), device)
    freq = batch.frequency_penalty[pen_rows]
    pres = batch.presence_penalty[pen_rows]
    sel = [k for k in np.flatnonzero((freq != 0) | (pres != 0)).tolist()
           if len(views[k].out_ids)]
    if sel:
        lens = [len(views[k].out_ids) for k in sel]
        counts = np.concatenate([views[k].out_counts for k in sel])
        pen.out_rows = _tensor(np.repeat(idx[sel], lens), device)
        pen.out_ids = _tensor(np.concatenate([views[k].out_ids for k in sel]), device)
        pen.out_penalty = _tensor((np.repeat(freq[sel], lens) * counts
                                   + np.repeat(pres[sel], lens)).astype(np.float32), device)
    return pen if pen.rep_rows is not None or pen.out_rows is not None else None


@dataclass(slots=True)
class _PenaltyView:
    out_ids: np.ndarray
    out_counts: np.ndarray
    seen_ids: np.ndarray | None


def _with_drafts(state: PenaltyState, drafts: list[int]) -> _PenaltyView:
    out, seen = state.output, state.seen
    view = _PenaltyView(out.ids[:out.n], out.counts[:out.n],
                        seen.ids[:seen.n] if seen is not None else None)
    if not drafts:
        return view
    extra = GrowingIds([])
    for t in drafts:
        extra.add(t)
    new_ids, new_counts = extra.ids[:extra.n], extra.counts[:extra.n]
    counts = view.out_counts.copy()
    fresh = []
    for t, c in zip(new_ids.tolist(), new_counts.tolist()):
        pos = out.position(t)
        if pos is None:
            fresh.append((t, c))
        else:
            counts[pos] += c
    view.out_counts = np.concatenate([counts, np.asarray([c for _, c in fresh], np.int64)])
    view.out_ids = np.concatenate([view.out_ids, np.asarray([t for t, _ in fresh], np.int64)])
    if seen is not None:
        unseen = [t for t in new_ids.tolist() if seen.position(t) is None]
        view.seen_ids = np.concatenate([view.seen_ids, np.asarray(unseen, np.int64)])
    return view


def _penalty_state(batch: InputBatch, row: int) -> PenaltyState:
    """The row's counts, built once from its tokens (also after preemption), then updated by
    :func:`record_sampled_tokens`."""
    extras = batch.extras[row]
    if extras.penalty is None:
        extras.penalty = PenaltyState.build(
            batch.token_ids[row, :batch.num_prompt_tokens[row]].tolist(),
            batch.output_token_ids(row).tolist(), batch.repetition_penalty[row] != 1.0)
    return extras.penalty
