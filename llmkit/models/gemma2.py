"""Gemma 2 (``Gemma2ForCausalLM``): the Gemma body with one rope for every layer, attention
scores soft-capped at ``attn_logit_softcapping`` and the final logits at
``final_logit_softcapping`` (both ``c * tanh(x / c)``)."""
from __future__ import annotations

import torch

from llmkit.models.gemma import FULL, SLIDING, GemmaForCausalLM
from llmkit.models.layers.rotary import compute_inv_freq
from llmkit.models.llama import _head_dim


class Gemma2ForCausalLM(GemmaForCausalLM):
    def attn_soft_cap(self, config) -> float | None:
        cap = getattr(config, "attn_logit_softcapping", None)
        return None if cap is None else float(cap)

    def rope_by_type(self, config) -> dict[str, tuple[torch.Tensor, float]]:
        rope = compute_inv_freq(config, _head_dim(config))
        return {SLIDING: rope, FULL: rope}
