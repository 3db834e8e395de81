"""What the sampler needs to know about one step's rows: plain tensors, built by the runner.

Every optional part is ``None`` when no row of the step needs it, so the sampler skips that
step entirely (a greedy-only batch without processors is a bare argmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PenaltyInputs:
    """Presence / frequency / repetition penalties as sparse (row, token) entries.

    A row's penalties touch only the tokens it has seen, a few hundred of a vocabulary of
    ~10^5: gathering and scattering those costs O(seen tokens), where dense ``[B, V]`` count
    tensors would cost O(B x V) per step.
    """

    # Repetition (prompt + output tokens, each once): rows, token ids, the row's penalty.
    rep_rows: torch.Tensor | None = None  # int64 [N]: indices into the step's rows
    rep_ids: torch.Tensor | None = None  # int64 [N]
    rep_penalty: torch.Tensor | None = None  # float32 [N]
    # Frequency and presence (output tokens, each once): ``frequency * count + presence``.
    out_rows: torch.Tensor | None = None  # int64 [M]
    out_ids: torch.Tensor | None = None  # int64 [M]
    out_penalty: torch.Tensor | None = None  # float32 [M]

    @classmethod
    def from_dense(cls, rows: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                   repetition: torch.Tensor, output_counts: torch.Tensor,
                   prompt_mask: torch.Tensor | None = None) -> "PenaltyInputs":
        """From per-row penalties ``[P]`` and dense ``[P, V]`` output counts / prompt mask
        (tests and benchmarks; the runner builds the sparse form directly)."""
        pen = cls()
        seen = output_counts > 0
        if prompt_mask is not None:
            seen = seen | prompt_mask
        if bool((repetition != 1.0).any()):
            i, t = seen.nonzero(as_tuple=True)
            pen.rep_rows, pen.rep_ids, pen.rep_penalty = rows[i], t, repetition[i]
        i, t = (output_counts > 0).nonzero(as_tuple=True)
        if len(i):
            counts = output_counts[i, t].to(torch.float32)
            pen.out_rows, pen.out_ids = rows[i], t
            pen.out_penalty = frequency[i] * counts + presence[i]
        return pen


@dataclass(slots=True)
class SpecDecodeMetadata:
    """Draft tokens to verify (speculative decoding). The logits rows are grouped by request,
    ``num_logits[i]`` consecutive rows for request i: its K drafts and a bonus position.
    ``draft_token_ids[r]`` is the draft that logits row ``r`` verifies (-1 for the last row of
    each request, which only samples). Drafts are given as tokens (a one-hot proposal q)."""

    draft_token_ids: torch.Tensor  # int64 [R]
    num_logits: list[int]
    # The proposal distribution q of each row's draft (a draft model's); None = every draft
    # is a plain token (one-hot q). Rows without a draft (bonus rows) are zero.
    draft_probs: torch.Tensor | None = None  # float32 [R, V]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters for the rows being sampled this step (``B`` rows, vocabulary ``V``)."""

    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # int64 [B]; 0 = off
    top_p: torch.Tensor | None = None  # float32 [B]; 1 = off
    min_p: torch.Tensor | None = None  # float32 [B]; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> own RNG
    # The structured-output seam: True = may be sampled. None = everything allowed.
    token_mask: torch.Tensor | None = None  # bool [B, V]
    # Structured output: xgrammar's packed bitmask, one int32 row of ceil(V / 32) words per
    # row (bit i of word j allows token 32 j + i; unconstrained rows all ones).
    grammar_bitmask: torch.Tensor | None = None
    # allowed_token_ids: rows listed in ``rows`` may sample only the listed ids.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) int64
    # Set to -inf: bad words whose prefix was just generated, EOS / stop ids before min_tokens.
    banned_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) int64
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, bias
    penalties: PenaltyInputs | None = None
    # Top-k logprobs to return for every row (the batch's largest k); None = no logprobs.
    max_num_logprobs: int | None = None
    # Draft tokens to verify; None = one independent sample per row.
    spec: SpecDecodeMetadata | None = None

    @property
    def has_processors(self) -> bool:
        return (self.token_mask is not None or self.grammar_bitmask is not None
                or self.allowed_token_ids is not None
                or self.banned_token_ids is not None or self.logit_bias is not None
                or self.penalties is not None)
