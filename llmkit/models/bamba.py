"""Bamba (IBM's Mamba-2 / attention hybrid): Mamba-2 mixer layers with a few Llama-style
attention layers at ``attn_layer_indices``, each followed by a gated MLP.

The recurrent hybrid of issue 33, chosen because it is the plainest one: unmodified Mamba-2
mixers (the shared ``layers/mamba2.py``, also what Granite-4 hybrids and Falcon-H1 build on)
beside Llama's attention and MLP, so what is new is only the state a mixer keeps — a fixed
conv + SSM state per request (``RecurrentStateSpec``), one block per request — and not a second
new layer kind (Granite-4's MoE, Qwen3-Next's gated DeltaNet) at the same time.

Attention layers rotate only the first half of each head (transformers fixes Bamba's
``partial_rotary_factor`` at 0.5). What the model does not support: tensor or pipeline
parallel, speculative decoding (a rejected draft token would have advanced the state) and
prefix caching (a cached block holds no state to resume from); see the README.
"""
from __future__ import annotations

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import KVCacheSpec
from llmkit.distributed.pipeline import IntermediateTensors
from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.layers.embedding import VocabEmbedding
from llmkit.models.layers.linear import Linear
from llmkit.models.kv_specs import bamba_kv_specs
from llmkit.models.layers.mamba2 import Mamba2Mixer, recurrent_batch
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from llmkit.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _head_dim
from llmkit.ops.base import RotaryTables
from llmkit.ops.mamba import RecurrentBatch


def _rotary_dim(config) -> int:
    # transformers 5 keeps the factor in rope_parameters, 4.x as a config attribute
    factor = rope_parameters(config).get("partial_rotary_factor") or \
        getattr(config, "partial_rotary_factor", None) or 1.0
    return int(_head_dim(config) * float(factor))


class PartialRotaryAttention(LlamaAttention):
    """Llama's attention rotating the first ``rotary_dim`` channels of each q/k head only."""

    def __init__(self, config, prefix: str, ctx: ModelContext) -> None:
        super().__init__(config, prefix, ctx)
        self.rotary_dim = _rotary_dim(config)

    def forward(self, x: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n, h, hkv, d, rot = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, \
            self.rotary_dim
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(n, h + hkv, d)
        # (contiguous: the platform's rotary rotates whole rows in place)
        qk = torch.cat([self.ops.rotary(qk[..., :rot].contiguous(), rope), qk[..., rot:]], -1)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, qk_size:].view(n, hkv, d)
        o = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


class BambaDecoderLayer(nn.Module):
    """A Mamba-2 mixer or attention, then the gated MLP, each after an RMSNorm."""

    def __init__(self, config, prefix: str, ctx: ModelContext, is_attention: bool) -> None:
        super().__init__()
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = PartialRotaryAttention(config, f"{prefix}.self_attn", ctx)
        else:
            self.mamba = Mamba2Mixer(config, f"{prefix}.mamba", ctx)
        self.feed_forward = LlamaMLP(config, f"{prefix}.feed_forward", ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype,
                                       ctx.ops)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype,
                                        ctx.ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTables | None,
                cache, md: AttentionMetadata, batch: RecurrentBatch | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, cache, md) if self.is_attention else \
            self.mamba(x, cache, batch)
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class BambaModel(nn.Module):
    def __init__(self, config, prefix: str, ctx: ModelContext) -> None:
        super().__init__()
        attn = set(config.attn_layer_indices or ())
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype,
                                           ctx.tp)
        self.layers = nn.ModuleList([
            BambaDecoderLayer(config, f"{prefix}.layers.{i}", ctx, i in attn)
            for i in range(config.num_hidden_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype,
                                       ctx.ops)
        self.rotary_emb = None
        if attn:
            rot = _rotary_dim(config)
            inv_freq, scaling = compute_inv_freq(config, rot)
            self.rotary_emb = RotaryEmbedding(rot, config.max_position_embeddings, inv_freq,
                                              scaling, ctx.dtype)
        # (matches LlamaModel's facts, which LlamaForCausalLM's methods read)
        self.start_layer, self.end_layer = 0, config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list, attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        residual = None
        rope = self.rotary_emb.lookup(positions) if self.rotary_emb is not None else None
        batches: dict[int, RecurrentBatch] = {}  # one per group's metadata, built once
        for i, layer in enumerate(self.layers):
            md = attn_metadata.for_layer(i)
            batch = None
            if not layer.is_attention:
                batch = batches.get(id(md))
                if batch is None:
                    batch = batches[id(md)] = recurrent_batch(md)
            x, residual = layer(x, residual, rope, kv_caches[i], md, batch)
        x, _ = self.final_layernorm(x, residual)
        return x


class BambaForCausalLM(LlamaForCausalLM):
    """Registered for ``BambaForCausalLM``. Reuses Llama's head, logits, embedding lookup and
    weight loading (checkpoint names map one to one; q/k/v and gate/up are fused the same
    way)."""

    supports_pp = False
    supports_kv_layer_hook = False

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model") -> None:
        CausalLM.__init__(self, hf_config, ctx)
        config = hf_config
        if ctx.pp.size > 1:
            raise ValueError("parallel.pipeline_parallel_size > 1 is not supported by Bamba "
                             f"(got {ctx.pp.size}; allowed: 1)")
        self.model = BambaModel(config, prefix, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear.build("lm_head", config.hidden_size, config.vocab_size,
                                    bias=False, dtype=ctx.dtype,
                                    linear_method=ctx.linear_method, parallel="column",
                                    gather_output=True)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.method.tied_embedding = self.model.embed_tokens
        self.attn_layers = sorted(set(config.attn_layer_indices or ()))
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Attention layers keep K/V per token; Mamba-2 layers a fixed (conv, SSM) state
        (float32, one block per request)."""
        return bamba_kv_specs(self.config)
