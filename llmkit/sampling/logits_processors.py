"""Logits processors that change which tokens are possible or how likely: token masks, bias,
penalties. They run before temperature, in place on a float32 ``[B, V]`` tensor the sampler
owns.

Order (fixed, as vLLM's): token constraints (external mask, allowed ids, banned ids — bad
words and min_tokens — and logit bias; these commute, since -inf stays -inf under addition)
then penalties (repetition, frequency, presence).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    # annotations only: the sampler, which defines them, calls these processors
    from llmkit.sampling.sampler import PenaltyInputs, SamplingMetadata

_NEG_INF = float("-inf")


def apply_token_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Grammar bitmask, external mask, allowed ids, banned ids and logit bias, in place."""
    if meta.grammar_bitmask is not None:
        import xgrammar  # the structured-output backend's C++ (CPU) / Triton (GPU) kernel

        xgrammar.apply_token_bitmask_inplace(logits, meta.grammar_bitmask,
                                             vocab_size=logits.shape[-1])
    keep = meta.token_mask
    if meta.allowed_token_ids is not None:
        rows, ids = meta.allowed_token_ids
        allowed = torch.ones_like(logits, dtype=torch.bool)
        allowed[rows] = False  # rows with an allow-list: nothing but the list
        allowed[rows, ids] = True
        keep = allowed if keep is None else keep & allowed
    if keep is not None:
        logits.masked_fill_(~keep, _NEG_INF)
    if meta.banned_token_ids is not None:
        rows, ids = meta.banned_token_ids
        logits[rows, ids] = _NEG_INF
    if meta.logit_bias is not None:
        rows, ids, bias = meta.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> None:
    """Penalties, in place, on the (row, token) entries listed in ``pen``.

    repetition (HF's ``RepetitionPenaltyLogitsProcessor``, CTRL): for tokens seen in the prompt
    or output, ``l / r`` if ``l > 0`` else ``l * r``. Then OpenAI's
    ``l - frequency * count - presence * (count > 0)`` over the output's token counts.
    """
    if pen.rep_rows is not None:
        idx = (pen.rep_rows, pen.rep_ids)
        x = logits[idx]
        r = pen.rep_penalty
        logits[idx] = torch.where(x > 0, x / r, x * r)
    if pen.out_rows is not None:
        logits.index_put_((pen.out_rows, pen.out_ids), -pen.out_penalty, accumulate=True)
