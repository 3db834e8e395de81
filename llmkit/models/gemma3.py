"""Gemma 3 text (``Gemma3ForCausalLM``, ``Gemma3TextConfig`` checkpoints): the Gemma body with
per-head q/k RMSNorms and two ropes -- the sliding layers' local base (10k on the Hub) and the
full layers' global base (1M), the latter optionally scaled (``linear``, factor 8 on the larger
checkpoints). Attention scores are not soft-capped (Hugging Face's Gemma 3 passes no soft cap
to its attention even when the config names one); final logits are when
``final_logit_softcapping`` is set.

The rope settings are read in both spellings: transformers 5's per-layer-type
``rope_parameters`` (``{"sliding_attention": {...}, "full_attention": {...}}``) and the Hub's
``rope_theta`` + ``rope_local_base_freq`` + ``rope_scaling``.
"""
from __future__ import annotations

import torch

from llmkit.models.gemma import FULL, SLIDING, GemmaForCausalLM
from llmkit.models.llama import _head_dim

#: transformers' defaults (``Gemma3TextConfig.default_theta``)
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def gemma3_rope_parameters(config) -> dict[str, dict]:
    """``{layer kind: {"rope_type", "rope_theta", ["factor"]}}`` from either spelling."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(k in (SLIDING, FULL) for k in params):
        out = {k: dict(v or {}) for k, v in params.items()}
    else:  # the Hub's flat keys (transformers 4 configs)
        full = dict(getattr(config, "rope_scaling", None) or {})
        if params:  # a flat rope_parameters: the global rope's
            full.update(params)
        full.setdefault("rope_theta", getattr(config, "rope_theta", None)
                        or DEFAULT_THETA[FULL])
        local = {"rope_type": "default", "rope_theta": getattr(
            config, "rope_local_base_freq", None) or DEFAULT_THETA[SLIDING]}
        out = {FULL: full, SLIDING: local}
    for kind in (SLIDING, FULL):
        p = out.setdefault(kind, {})
        p.setdefault("rope_type", p.get("type", "default"))
        p.setdefault("rope_theta", DEFAULT_THETA[kind])
    return out


def inv_freq_for(params: dict, head_dim: int, key: str) -> tuple[torch.Tensor, float]:
    """Hugging Face's default and linear rope tables (the kinds Gemma 3 ships with)."""
    kind = params["rope_type"]
    if kind not in ("default", "linear"):
        raise ValueError(f"{key} rope_type {kind!r} is not supported for Gemma 3 "
                         "(supported: default, linear)")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    return inv_freq, 1.0


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True

    def rope_by_type(self, config) -> dict[str, tuple[torch.Tensor, float]]:
        d = _head_dim(config)
        return {kind: inv_freq_for(p, d, f"rope_parameters[{kind!r}]")
                for kind, p in gemma3_rope_parameters(config).items()}
