"""Rotary position embedding, neox ("rotate half") layout, from a cos/sin table indexed by
position.

The inverse frequencies come from transformers' rope code, so every scaling variant it
implements as a fixed table (``default``, ``linear``, ``llama3``, ``yarn``) matches the
reference. Variants whose frequencies change with the sequence length at run time (``dynamic``,
``longrope``) are refused rather than approximated.
"""
from __future__ import annotations

import torch
from torch import nn

from llmkit.ops.base import ModelOps, RotaryTables

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    """The rope settings of a config: transformers 5's ``rope_parameters`` (which holds
    ``rope_theta``), or transformers 4's ``rope_theta`` + ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported by llmkit's Llama "
                         f"family implementation: {params}")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for a Hugging Face config."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    if inv_freq.shape[0] * 2 != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported (rotary dim "
                         f"{inv_freq.shape[0] * 2}, head_dim {head_dim})")
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache [max_position, head_dim]``: cos of each frequency in the first half,
    sin in the second, already multiplied by the attention scaling.

    ``mrope_section`` (Qwen2-VL's M-RoPE): the half head dim is cut into sections (temporal,
    height, width), each rotated by its own row of ``positions [len(sections), tokens]``."""

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float, dtype: torch.dtype,
                 mrope_section: list[int] | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
        cache = torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], -1)
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)
        section_of_column = None
        if mrope_section:
            half = cache.shape[-1] // 2
            if sum(mrope_section) != half:
                raise ValueError(f"mrope_section {mrope_section} must sum to half the rotary "
                                 f"dim ({half})")
            section = torch.repeat_interleave(torch.arange(len(mrope_section)),
                                              torch.tensor(mrope_section))
            section_of_column = torch.cat([section, section])
        self.register_buffer("section_of_column", section_of_column, persistent=False)

    def lookup(self, positions: torch.Tensor) -> RotaryTables:
        """The step's tables, looked up once and shared by every layer; ``positions`` is
        ``[tokens]``, or ``[sections, tokens]`` with M-RoPE."""
        if positions.dim() == 1:
            cos_sin = self.cos_sin_cache.index_select(0, positions)
        else:
            if self.section_of_column is None:
                raise ValueError("per-section positions need a model with mrope_section")
            per_section = self.cos_sin_cache[positions]  # [sections, tokens, rot_dim]
            index = self.section_of_column.view(1, 1, -1).expand(1, *per_section.shape[1:])
            cos_sin = per_section.gather(0, index)[0]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return RotaryTables(cos_sin, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [num_tokens, num_heads, head_dim]`` (any strides) into a new tensor (the
    reference's numerics, ``ModelOps.rotary``)."""
    return ModelOps().rotary(x, RotaryTables(torch.empty(0), cos, sin))
