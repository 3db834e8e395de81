"""What one layer keeps for a request: its KV-cache spec (seed ch. 09, the runtime layer).

A model declares one spec per layer (``CausalLM.kv_cache_specs()``); layers with equal specs
form a KV-cache group, every group draws its blocks from one pool, and the attention metadata
carries one block table per group. The scheduler sees tokens and blocks only, never a spec's
shape. The specs live beside the attention backends (below the model and the KV cache manager,
which both read them).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from math import prod

import torch


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class KVCacheSpec(ABC):
    """A layer's per-request state. ``page_bytes`` is one block's bytes in this layer."""

    @abstractmethod
    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int: ...

    @abstractmethod
    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one more token of context costs (0 for a fixed-size state)."""


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V per KV head for every token of the context."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * _element_size(dtype)

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V for the last ``sliding_window`` tokens only: a query at position p sees keys at
    positions ``p - sliding_window + 1 .. p`` (Hugging Face's convention); blocks wholly
    before that can be freed while the request runs."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


@dataclass(frozen=True, slots=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent row per token,
    ``kv_lora_rank`` normalized latent values followed by ``qk_rope_head_dim`` roped key
    values, shared by every head; the up-projections are applied at read time."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.latent_dim * _element_size(dtype)

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec(KVCacheSpec):
    """A fixed-size state per request (Mamba-2's conv and SSM states, DeltaNet's matrix):
    one block per request whatever its length. ``shapes`` are the state tensors' shapes for
    one request, in the model's dtype unless ``dtype`` is given."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None

    def state_bytes(self, dtype: torch.dtype) -> int:
        size = _element_size(self.dtype or dtype)
        return sum(prod(s) for s in self.shapes) * size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return self.state_bytes(dtype)


def layer_ranges(layers: list[int], sep: str = ", ") -> str:
    """``0-4, 6-10, 12`` for sorted layer indices: the layers of a spec or a KV-cache group,
    in words (the model's and the KV cache manager's descriptions both use it)."""
    out: list[str] = []
    start = prev = layers[0]
    for i in [*layers[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return sep.join(out)
