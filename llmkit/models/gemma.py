"""The Gemma 2 / Gemma 3 text decoder: what both share, built from the Llama blocks.

Differences from Llama: RMSNorms scale by ``1 + w``; each layer norms four times (before and
after attention, before and after the MLP: "sandwich" norms); the embedding is multiplied by
``sqrt(hidden_size)``; the MLP is GeGLU (``gelu_pytorch_tanh``); scores are scaled by
``query_pre_attn_scalar ** -0.5``; layers alternate sliding-window and full attention
(``layer_types``), each declaring its KV-cache spec; the LM head is tied to the embedding.
``Gemma2ForCausalLM`` adds the attention and final-logit soft-caps; ``Gemma3ForCausalLM`` the
q/k norms and a rope base of its own for the sliding layers.
"""
from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.kv_specs import gemma_layer_types
from llmkit.models.layers.activation import GeluTanhAndMul
from llmkit.models.layers.embedding import VocabEmbedding
from llmkit.models.layers.linear import Linear
from llmkit.models.layers.norm import GemmaRMSNorm
from llmkit.models.layers.rotary import RotaryEmbedding
from llmkit.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                 LlamaMLP, _head_dim)

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config) -> list[str]:
    """Each layer's attention kind (the same list the KV-cache specs are built from)."""
    types = gemma_layer_types(config)
    n = config.num_hidden_layers
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types {list(types)}: need {n} entries, each one of "
                         f"{SLIDING!r}, {FULL!r}")
    if SLIDING in types and not getattr(config, "sliding_window", None):
        raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                         f"{getattr(config, 'sliding_window', None)!r} (need a positive int)")
    return list(types)


def gemma_act(config) -> GeluTanhAndMul:
    """The MLP's gate: GeGLU (``gelu_pytorch_tanh``), the one activation Gemma 2/3 ship with."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not supported by the Gemma "
                         "implementation (only gelu_pytorch_tanh)")
    return GeluTanhAndMul()


def gemma_layer(config, prefix: str, ctx: ModelContext, *, sliding_window: int | None,
                logits_soft_cap: float | None, qk_norm: bool) -> LlamaDecoderLayer:
    """Llama's decoder layer with Gemma's differences: ``1 + w`` norms (q/k too, Gemma 3),
    sandwich norms, GeGLU, scores scaled by ``query_pre_attn_scalar ** -0.5``."""
    attn = LlamaAttention(config, f"{prefix}.self_attn", ctx,
                          scale=float(config.query_pre_attn_scalar) ** -0.5,
                          qk_norm=GemmaRMSNorm if qk_norm else None,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    mlp = LlamaMLP(config, f"{prefix}.mlp", ctx, act_fn=gemma_act(config))
    return LlamaDecoderLayer(config, prefix, ctx, mlp, attn=attn, norm=GemmaRMSNorm,
                             sandwich=True)


class GemmaModel(nn.Module):
    """Hugging Face's ``Gemma2Model`` / ``Gemma3TextModel``: module names match the
    checkpoint's (``model.layers.0.self_attn.q_proj``...), so weights and LoRA adapters map
    one to one."""

    def __init__(self, config, prefix: str, ctx: ModelContext, kinds: list[str],
                 soft_cap: float | None, qk_norm: bool,
                 rope_by_type: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        window = getattr(config, "sliding_window", None)
        self.layer_types = kinds
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype,
                                           ctx.tp)
        # Hugging Face multiplies by the scale cast to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5,
                                                         dtype=ctx.dtype), persistent=False)
        self.layers = nn.ModuleList(
            gemma_layer(config, f"{prefix}.layers.{i}", ctx,
                        sliding_window=window if kind == SLIDING else None,
                        logits_soft_cap=soft_cap, qk_norm=qk_norm)
            for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.ops)
        head_dim = _head_dim(config)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, config.max_position_embeddings, inv_freq, scaling,
                                  ctx.dtype)
            for kind, (inv_freq, scaling) in rope_by_type.items() if kind in kinds})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # (the embedding is a fresh tensor this forward owns: the residual stream updates it)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        ropes = {kind: rotary.lookup(positions) for kind, rotary in self.rotary.items()}
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ropes[self.layer_types[i]], kv_caches[i],
                                attn_metadata.for_layer(i))
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(CausalLM):
    """The shared body; subclasses say which rope each layer kind uses, whether attention
    scores are soft-capped and whether q/k are normed (``rope_by_type``, ``attn_soft_cap``,
    ``qk_norm``)."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    applies_sliding_window = True
    qk_norm = False

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model") -> None:
        super().__init__(hf_config, ctx)
        config = hf_config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an encoder) is not supported "
                             "by the Gemma causal LM implementation")
        if ctx.pp.size > 1:
            raise ValueError("parallel.pipeline_parallel_size > 1 is not supported for Gemma "
                             "models (allowed: 1)")
        self.model = GemmaModel(config, prefix, ctx, layer_types(config),
                                self.attn_soft_cap(config), self.qk_norm,
                                self.rope_by_type(config))
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)
        self.lm_head = Linear.build("lm_head", config.hidden_size, config.vocab_size,
                                    bias=False, dtype=ctx.dtype,
                                    linear_method=ctx.linear_method, parallel="column",
                                    gather_output=True)
        # Tied (Gemma's checkpoints hold no lm_head): the head computes with the embedding
        self.tie_word_embeddings = True
        self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head.method.tied_embedding = self.model.embed_tokens
        attn = self.model.layers[0].self_attn
        self.num_layers = len(self.model.layers)
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size

    # -- what the variants decide --------------------------------------------------------
    def attn_soft_cap(self, config) -> float | None:
        return None

    @abstractmethod
    def rope_by_type(self, config) -> dict[str, tuple[torch.Tensor, float]]:
        """``{layer kind: (inv_freq, attention_scaling)}``."""

    # -- the interface ---------------------------------------------------------------------
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [SlidingWindowSpec(self.num_kv_heads, self.head_dim,
                                  sliding_window=layer.self_attn.sliding_window)
                if layer.self_attn.sliding_window else
                FullAttentionSpec(self.num_kv_heads, self.head_dim)
                for layer in self.model.layers]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()
        if self.final_soft_cap is not None:
            cap = float(self.final_soft_cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    load_weights = LlamaForCausalLM.load_weights
