"""Prompt lookup (n-gram) drafts: copy what followed the request's own suffix before.

For each row, the longest suffix of its tokens (prompt + output) of ``prompt_lookup_min`` to
``prompt_lookup_max`` tokens that also occurs earlier in them proposes the (up to K) tokens that
followed its most recent earlier occurrence. No model and no KV of its own; strong where the
output copies from the input (edits, rewrites, code, extraction), silent elsewhere (a row
without a match is not drafted).

Vectorised over the batch: the rows' tokens are one ``[R, L]`` array; a match of length n
ending at position i is ``match_{n-1}[:, i] & (tokens[:, i - n + 1] == suffix[:, n - 1])``, so
the whole search is ``prompt_lookup_max`` boolean passes over that array, no per-token loop.
"""
from __future__ import annotations

import numpy as np

from llmkit.spec_decode.base import Proposer, ProposerBatch, ProposerEnv, StepContext


def find_drafts(tokens: np.ndarray, lengths: np.ndarray, k: int, min_n: int,
                max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lookup over rows: ``tokens [R, L]`` (row r valid in ``[:lengths[r]]``).

    Returns ``(drafts [R, k], counts [R])``: row r's proposal is ``drafts[r, :counts[r]]``
    (count 0: no suffix of ``min_n``..``max_n`` tokens occurs earlier). Among matches the
    longest suffix wins, then its most recent earlier occurrence.
    """
    num_rows, width = tokens.shape
    if num_rows == 0 or width == 0 or k <= 0:
        return np.zeros((num_rows, max(k, 0)), dtype=tokens.dtype), np.zeros(num_rows, np.int64)
    r_idx = np.arange(num_rows)
    pos = np.arange(width)
    # a match ends at i <= L - 2 (a token follows it) and is not the suffix itself
    in_range = pos[None, :] <= (lengths - 2)[:, None]
    best_end = np.full(num_rows, -1, dtype=np.int64)
    match = in_range
    for n in range(1, max_n + 1):
        suffix_tok = tokens[r_idx, np.maximum(lengths - n, 0)]  # [R]: the suffix's n-th last
        shifted = np.empty_like(tokens)
        shifted[:, n - 1:] = tokens[:, :width - n + 1]
        shifted[:, :n - 1] = -1  # no token before the start
        match = match & (shifted == suffix_tok[:, None]) & (lengths >= n + 1)[:, None]
        found = match.any(axis=1)
        if not found.any():
            break
        if n >= min_n:
            last = width - 1 - np.argmax(match[:, ::-1], axis=1)  # most recent end
            best_end = np.where(found, last, best_end)
    start = best_end + 1
    counts = np.where(best_end >= 0, np.minimum(k, lengths - start), 0)
    gather = np.clip(start[:, None] + np.arange(k)[None, :], 0, width - 1)
    drafts = np.take_along_axis(tokens, gather, axis=1)
    return drafts, counts.astype(np.int64)


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, max_model_len: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min ({prompt_lookup_min}) <= max "
                             f"({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    @classmethod
    def from_config(cls, config, env: ProposerEnv) -> "NgramProposer":
        return cls(config.num_speculative_tokens, config.prompt_lookup_min,
                   config.prompt_lookup_max, env.max_model_len)

    def propose(self, batch: ProposerBatch, rows: np.ndarray,
                step: StepContext | None = None) -> dict[str, list[int]]:
        k = self.num_drafts(len(rows), batch.num_reqs)
        if k <= 0 or not len(rows):
            return {}
        lengths = np.minimum(batch.num_tokens[rows], self.max_model_len)
        tokens = batch.token_ids[rows, :int(lengths.max())]
        drafts, counts = find_drafts(tokens, lengths, k, self.min_n, self.max_n)
        # drafts past max_model_len could never be kept
        counts = np.minimum(counts, self.max_model_len - lengths)
        out: dict[str, list[int]] = {}
        req_ids = batch.req_ids
        for i in np.flatnonzero(counts > 0).tolist():
            out[req_ids[int(rows[i])]] = drafts[i, :int(counts[i])].tolist()
        return out
