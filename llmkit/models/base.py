"""The model interface the worker calls: a causal LM over a flat batch of many requests' tokens.

A model is *what* is computed, written once in Python. *How* comes from its
:class:`ModelContext`: the platform's ops (norm, rotary, activation; the attention backend's
KV write and paged attention) and a linear method per linear layer. The model owns no KV
state: each attention layer receives its cache tensor and the step's metadata as arguments.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import FullAttentionSpec, KVCacheSpec
# re-exported: ModelContext is part of the model interface (every model takes one); it is
# defined with the layers, which take it too and must not import this package
from llmkit.models.layers.context import ModelContext
from llmkit.models.layers.linear import Linear

__all__ = ["CausalLM", "ModelContext"]


class CausalLM(nn.Module, ABC):
    """A decoder-only language model built from a Hugging Face config.

    ``forward`` takes ``input_ids`` (int64 ``[num_tokens]``, the tokens of every scheduled
    request concatenated) or ``inputs_embeds [num_tokens, hidden]`` (multimodal inputs),
    ``positions`` (``[num_tokens]``, or ``[sections, num_tokens]`` for M-RoPE), one KV cache
    tensor per layer (shape ``attn_backend.kv_cache_shape(...)``) and the step's metadata, and
    returns the final hidden states ``[num_tokens, hidden_size]``; ``compute_logits`` maps
    selected rows to float32 logits.
    """

    # KV layout facts the engine needs to size the cache.
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    #: Fused layers and the checkpoint modules stacked into them, in shard order (vLLM's
    #: name), e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``: LoRA adapters name the
    #: checkpoint's modules.
    packed_modules_mapping: dict[str, list[str]] = {}
    #: Whether ``forward`` calls ``attn_metadata.kv_layer_hook`` around each layer (KV
    #: connectors then overlap their transfers with the layers); if not, the runner waits for
    #: every layer's loads before the forward and hands every layer over after it.
    supports_kv_layer_hook: bool = False
    #: Whether the model builds only its pipeline stage's layers (``parallel.
    #: pipeline_parallel_size > 1``; the others are ``PPMissingLayer``).
    supports_pp: bool = False
    #: Whether the model's sliding-window layers attend within their window (they declare
    #: ``SlidingWindowSpec``s): the loader then keeps ``max_position_embeddings`` as the
    #: length limit instead of capping it at the config's ``sliding_window``.
    applies_sliding_window: bool = False

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__()
        self.config = hf_config
        self.ctx = ctx
        self.attn_backend = ctx.attn_backend
        self.dtype = ctx.dtype

    @abstractmethod
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""

    @abstractmethod
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` -> ``[n, hidden]``: the token embeddings (multimodal processors splice image
        embeddings into these)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors, named as in the Hugging Face model, into the parameters."""

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each of this stage's layers keeps per request, in layer order (equal specs
        form one KV-cache group). The default: full attention, K and V per KV head."""
        return [FullAttentionSpec(self.num_kv_heads, self.head_dim)] * self.num_layers

    def process_weights_after_loading(self) -> None:
        """Let every linear layer's method prepare its weights (pack, repack, quantize)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
