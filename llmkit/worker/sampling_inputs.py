"""Per-step sampling inputs from the persistent batch.

Every part of :class:`SamplingMetadata` is built only when a row of this step needs it: the
per-row numpy columns answer "does any row need X" with one vectorised check, and a batch of
plain greedy rows costs a temperature slice and nothing more. Ragged data (bias, allow-lists,
bad words, min_tokens stop ids) is gathered by a Python loop over the rows that have it only.
"""
from __future__ import annotations

import numpy as np
import torch

from llmkit.sampling.bad_words import banned_next_tokens
from llmkit.sampling.metadata import PenaltyInputs, SamplingMetadata
from llmkit.worker.input_batch import InputBatch, PenaltyState

_GREEDY_EPS = 1e-5


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, token_masks: dict[str, object],
                            vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Metadata for sampling the step's ``rows`` (batch rows, in logits order)."""
    temperature = batch.temperature[rows]
    random = temperature >= _GREEDY_EPS
    any_random = bool(random.any())
    top_k = top_p = min_p = None
    generators: dict[int, torch.Generator] = {}
    if any_random:
        # Filters are only built when a random row uses them (greedy rows ignore them).
        k, p, mp = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        if ((k[random] > 0) & (k[random] < vocab_size)).any():
            top_k = _tensor(k, device)
        if (p[random] < 1.0).any():
            top_p = _tensor(p, device)
        if (mp[random] > 0.0).any():
            min_p = _tensor(mp, device)
        for i in np.flatnonzero(batch.has_seed[rows] & random).tolist():
            generators[i] = batch.generators[rows[i]]
    num_lp = batch.num_logprobs[rows]
    max_lp = int(num_lp.max())
    return SamplingMetadata(
        temperature=_tensor(temperature, device),
        all_greedy=not any_random,
        top_k=top_k, top_p=top_p, min_p=min_p,
        generators=generators,
        token_mask=_external_mask(batch, rows, token_masks, vocab_size, device),
        allowed_token_ids=_allowed(batch, rows, device),
        banned_token_ids=_banned(batch, rows, device),
        logit_bias=_bias(batch, rows, device),
        penalties=_penalties(batch, rows, device),
        max_num_logprobs=max_lp if max_lp >= 0 else None,
    )


def record_sampled_tokens(batch: InputBatch, rows: np.ndarray, tokens: list[int]) -> None:
    """Keep penalty counts current: the rows' new tokens join their outputs."""
    for i in np.flatnonzero(batch.has_penalties[rows]).tolist():
        state = batch.extras[rows[i]].penalty
        if state is not None:
            state.add(tokens[i])


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


def _external_mask(batch: InputBatch, rows: np.ndarray, token_masks: dict[str, object],
                   vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The structured-output seam: per request a bool ``[V]`` mask (True = allowed)."""
    if not token_masks:
        return None
    masks = [token_masks.get(batch.req_ids[r]) for r in rows]
    if all(m is None for m in masks):
        return None
    out = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, m in enumerate(masks):
        if m is not None:
            m = torch.as_tensor(m, dtype=torch.bool)
            out[i, :m.shape[-1]] = m.to(device)
    return out


def _allowed(batch: InputBatch, rows: np.ndarray,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    idx = np.flatnonzero(batch.has_allowed[rows]).tolist()
    return _pairs(idx, [batch.extras[rows[i]].allowed_ids for i in idx], device)


def _bias(batch: InputBatch, rows: np.ndarray, device: torch.device):
    idx = np.flatnonzero(batch.has_bias[rows]).tolist()
    extras = [batch.extras[rows[i]] for i in idx]
    return _pairs(idx, [e.bias_ids for e in extras], device, [e.bias_values for e in extras])


def _banned(batch: InputBatch, rows: np.ndarray,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bad words completed by the next token, and EOS / stop ids while below min_tokens."""
    row_idx: list[int] = []
    ids: list[np.ndarray] = []
    for i in np.flatnonzero(batch.has_bad_words[rows]).tolist():
        r = rows[i]
        banned = banned_next_tokens(batch.extras[r].bad_words, batch.output_token_ids(r))
        if banned:
            row_idx.append(i)
            ids.append(np.asarray(banned, dtype=np.int64))
    num_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    for i in np.flatnonzero(num_out < batch.min_tokens[rows]).tolist():
        stop_ids = batch.extras[rows[i]].min_tokens_stop_ids
        if len(stop_ids):
            row_idx.append(i)
            ids.append(stop_ids)
    return _pairs(row_idx, ids, device)


def _penalties(batch: InputBatch, rows: np.ndarray,
               device: torch.device) -> PenaltyInputs | None:
    idx = np.flatnonzero(batch.has_penalties[rows])
    if not len(idx):
        return None
    pen_rows = rows[idx]
    states = [_penalty_state(batch, int(r)) for r in pen_rows]
    pen = PenaltyInputs()
    rep = batch.repetition_penalty[pen_rows]
    has_rep = [s.seen is not None for s in states]
    if any(has_rep):
        sel = [k for k, h in enumerate(has_rep) if h]
        lens = [states[k].seen.n for k in sel]
        pen.rep_rows = _tensor(np.repeat(idx[sel], lens), device)
        pen.rep_ids = _tensor(np.concatenate([states[k].seen.ids[:states[k].seen.n]
                                              for k in sel]), device)
        pen.rep_penalty = _tensor(np.repeat(rep[sel], lens), device)
    freq = batch.frequency_penalty[pen_rows]
    pres = batch.presence_penalty[pen_rows]
    sel = [k for k in np.flatnonzero((freq != 0) | (pres != 0)).tolist() if states[k].output.n]
    if sel:
        lens = [states[k].output.n for k in sel]
        counts = np.concatenate([states[k].output.counts[:states[k].output.n] for k in sel])
        pen.out_rows = _tensor(np.repeat(idx[sel], lens), device)
        pen.out_ids = _tensor(np.concatenate([states[k].output.ids[:states[k].output.n]
                                              for k in sel]), device)
        pen.out_penalty = _tensor((np.repeat(freq[sel], lens) * counts
                                   + np.repeat(pres[sel], lens)).astype(np.float32), device)
    return pen if pen.rep_rows is not None or pen.out_rows is not None else None


def _penalty_state(batch: InputBatch, row: int) -> PenaltyState:
    """The row's counts, built once from its tokens (also after preemption), then updated by
    :func:`record_sampled_tokens`."""
    extras = batch.extras[row]
    if extras.penalty is None:
        extras.penalty = PenaltyState.build(
            batch.token_ids[row, :batch.num_prompt_tokens[row]].tolist(),
            batch.output_token_ids(row).tolist(), batch.repetition_penalty[row] != 1.0)
    return extras.penalty
