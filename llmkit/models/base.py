"""The model interface the worker calls: a causal LM over a flat batch of many requests' tokens.

The model owns no KV state: each attention layer receives its cache tensor and the step's
metadata as arguments and hands both to the attention backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch
from torch import nn

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.models.layers.linear import Linear


class CausalLM(nn.Module, ABC):
    """A decoder-only language model built from a Hugging Face config.

    ``forward`` takes ``input_ids`` and ``positions`` (int64 ``[num_tokens]``, the tokens of every
    scheduled request concatenated), one KV cache tensor per layer (shape
    ``attn_backend.kv_cache_shape(...)``) and the step's metadata, and returns the final hidden
    states ``[num_tokens, hidden_size]``; ``compute_logits`` maps selected rows to float32 logits.
    """

    # KV layout facts the engine needs to size the cache.
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    def __init__(self, hf_config, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.attn_backend = attn_backend
        self.dtype = dtype

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""

    def pack_linear_weights(self, compute_in_float32: bool = False) -> None:
        """After loading: add oneDNN-packed copies of every linear layer's weight, computing
        bf16 layers in float32 if asked (the platform decides, see
        ``Platform.linear_weight_packing``)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight(compute_in_float32=compute_in_float32)

    def use_native_kernels(self, kernels) -> None:
        """Hand the platform's C++ kernels (``torch.ops.llmkit_cpu``) to every layer that has
        a fused path for them (norms, activation, rotary)."""
        for module in self.modules():
            if module is not self and hasattr(module, "use_native_kernels"):
                module.use_native_kernels(kernels)

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors, named as in the Hugging Face model, into the parameters."""
