"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

One class reads the variant from the config. Q, K and V come from one fused projection and gate
and up from another; the checkpoint's separate matrices are stacked into them at load time.
Module names otherwise follow Hugging Face's so that checkpoint names map one to one.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.models.base import CausalLM
from llmkit.models.layers.activation import SiluAndMul
from llmkit.models.layers.embedding import VocabEmbedding
from llmkit.models.layers.linear import Linear, MergedLinear, copy_weight
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.rotary import (RotaryEmbedding, RotaryTables, apply_rotary,
                                         compute_inv_freq)

# (fused parameter, checkpoint module, shard id): vLLM's stacked_params_mapping.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# Checkpoint tensors that carry no parameter.
IGNORED_WEIGHTS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=attention_bias, dtype=dtype)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.kernels = None  # torch.ops.llmkit_cpu, when the platform provides them

    def use_native_kernels(self, kernels) -> None:
        """Rotate Q and K in place with the C++ CPU kernel (same roundings as the torch ops)."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n, h, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None:
            # Q and K rotate together: one op over their heads side by side.
            qk = qkv[:, :qk_size].view(n, h + hkv, d)
            if self.kernels is not None:
                self.kernels.rotary_embedding_(qk, rope.cos_sin)  # qkv is this layer's own
            else:
                qk = apply_rotary(qk, rope.cos, rope.sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :self.q_size].view(n, h, d)), rope.cos, rope.sin)
            k = apply_rotary(self.k_norm(qkv[:, self.q_size:qk_size].view(n, hkv, d)),
                             rope.cos, rope.sin)
        v = qkv[:, qk_size:].view(n, hkv, d)
        o = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama family "
                             "implementation (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": inter, "up": inter},
                                         bias=bias, dtype=dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(inter, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, attn_backend, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.kernels = None  # torch.ops.llmkit_cpu: the layer as one call for decode steps
        self._decode_args: tuple | None = None

    def use_native_kernels(self, kernels) -> None:
        """Run the layer as one C++ call (``llama_decode_layer``) when every row of a step
        decodes and there are at most ``Linear.native_max_rows``: the same kernels in the same
        order as ``forward``, without ~20 Python-dispatched ops. Not for per-head q/k norms
        (Qwen3), which that kernel does not apply."""
        self.kernels = kernels if self.self_attn.q_norm is None else None
        self._decode_args = None

    def forward_decode_native(self, x: torch.Tensor, residual: torch.Tensor, first: bool,
                              rope: RotaryTables, kv_cache: torch.Tensor,
                              paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                              ) -> torch.Tensor:
        """``forward`` for decoding rows through the C++ kernels; ``paged`` is the attention
        backend's ``native_decode_args``. ``residual`` is updated in place (with ``first`` it is
        ``x``); returns the MLP output."""
        if self._decode_args is None:  # the loaded parameters, gathered once
            attn, mlp = self.self_attn, self.mlp
            self._decode_args = (
                self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                attn.o_proj.weight, attn.o_proj.bias, self.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight,
                mlp.down_proj.bias, self.input_layernorm.eps)
        attn = self.self_attn
        return self.kernels.llama_decode_layer(
            x, residual, first, *self._decode_args, rope.cos_sin, kv_cache, *paged,
            attn.num_heads, attn.num_kv_heads, attn.scale)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTables,
                kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attn_backend, dtype)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        inv_freq, attention_scaling = compute_inv_freq(config, head_dim)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, inv_freq,
                                          attention_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.lookup(positions)
        first = self.layers[0]
        if first.kernels is not None and x.shape[0] <= Linear.native_max_rows:
            paged = first.self_attn.attn_backend.native_decode_args(attn_metadata)
            if paged is not None:
                residual = x
                for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                    x = layer.forward_decode_native(x, residual, i == 0, rope, kv_cache, paged)
                return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Registered for ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
    ``Qwen3ForCausalLM``."""

    def __init__(self, hf_config, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)
        config = hf_config
        if len(getattr(config, "layer_types", None) or ()) and \
                set(config.layer_types) != {"full_attention"}:
            raise ValueError(f"layer types {sorted(set(config.layer_types))} are not supported "
                             "(only full_attention)")
        self.model = LlamaModel(config, attn_backend, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.packed_tied_head: Linear | None = None
        self.num_layers = config.num_hidden_layers
        self.num_heads = self.model.layers[0].self_attn.num_heads
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.head_dim = _head_dim(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.lm_head or self.packed_tied_head
        if head is not None:
            return head(hidden_states).float()
        return torch.nn.functional.linear(hidden_states, self.model.embed_tokens.weight).float()

    def pack_linear_weights(self, compute_in_float32: bool = False) -> None:
        super().pack_linear_weights(compute_in_float32)
        if self.lm_head is None:
            # The output layer shares the embedding matrix and gets its own packed copy.
            head = Linear(self.hidden_size, self.vocab_size, bias=False, dtype=self.dtype)
            head.weight = self.model.embed_tokens.weight
            head.pack_weight(compute_in_float32=compute_in_float32)
            self.packed_tied_head = head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        expected = set()
        for name, param in params.items():
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, MergedLinear):
                expected.update((name, shard) for shard in module.shards)
            else:
                expected.add((name, None))
        loaded = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_WEIGHTS):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # a tied checkpoint that also stores the output matrix
            for fused, part, shard in STACKED_PARAMS:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    param = self._param(params, target, name)
                    module = self.get_submodule(target.rpartition(".")[0])
                    module.load_shard(param, tensor, shard, name)
                    loaded.add((target, shard))
                    break
            else:
                copy_weight(self._param(params, name, name), tensor, name)
                loaded.add((name, None))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of the model: "
                             f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        try:
            return params[target]
        except KeyError:
            raise ValueError(f"checkpoint weight {name!r} has no counterpart in the "
                             "model") from None
