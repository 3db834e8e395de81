"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (``layers/mla.py``) and a MoE of
shared plus routed experts behind DeepSeek's grouped routers (``llmkit/ops/moe_routing.py``).

The decoder stack is Llama's (``LlamaModel``) with MLA as each layer's attention; the first
``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) keep a dense gated MLP of
``intermediate_size``. A MoE layer sums the routed experts (``FusedMoE``, whose loader and
expert-parallel split are the MoE family's, ``moe.py``) and ``n_shared_experts`` always-on
experts (one gated MLP ``n_shared_experts * moe_intermediate_size`` wide). The router computes
in float32 (its weight is kept in float32, as in transformers).

What differs between the two is read from the config: V2 routes by softmax scores
(``topk_method`` greedy or ``group_limited_greedy``), V3 by sigmoid scores with
``e_score_correction_bias`` (``noaux_tc``) and may keep neox-layout rope (``rope_interleave``
false). transformers' DeepSeek-V2 never renormalises the top-k weights; llmkit follows
DeepSeek's own code and vLLM there (``norm_topk_prob``, false in DeepSeek-V2's checkpoints).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.attention.kv_spec import KVCacheSpec, MLASpec
from llmkit.models.base import ModelContext
from llmkit.models.layers.moe import FusedMoE
from llmkit.models.layers.mla import MLAAttention, deinterleave_rows
from llmkit.models.kv_specs import deepseek_kv_specs
from llmkit.models.llama import LlamaMLP, LlamaModel
from llmkit.models.moe import MoeForCausalLM, moe_shape
from llmkit.ops.moe_routing import softmax_group_topk, sigmoid_noaux_topk


def is_moe_layer(config, i: int) -> bool:
    """DeepSeek's rule (``moe_shape``): a MoE block from layer ``first_k_dense_replace`` on,
    every ``moe_layer_freq``-th layer."""
    return i in moe_shape(config).sparse_layers


def interleaved_rope(config) -> bool:
    """DeepSeek-V2 always rotates interleaved pairs; V3 unless ``rope_interleave`` is false."""
    return config.model_type != "deepseek_v3" or bool(getattr(config, "rope_interleave", True))


class DeepseekRouter(nn.Module):
    """The gate: float32 logits over the routed experts, then V2's or V3's choice."""

    def __init__(self, config) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = getattr(config, "n_group", None) or 1
        self.topk_group = getattr(config, "topk_group", None) or 1
        if e % self.n_group:
            raise ValueError(f"n_routed_experts {e} does not split into n_group "
                             f"{self.n_group} groups")
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.scaling = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.v3 = config.model_type == "deepseek_v3"
        self.method = "noaux_tc" if self.v3 else (getattr(config, "topk_method", None)
                                                   or "greedy")
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if self.v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        if self.v3:
            return sigmoid_noaux_topk(logits, self.e_score_correction_bias, self.top_k,
                                      n_group=self.n_group, topk_group=self.topk_group,
                                      renormalize=self.renormalize, scaling=self.scaling)
        return softmax_group_topk(logits, self.top_k, method=self.method,
                                  n_group=self.n_group, topk_group=self.topk_group,
                                  renormalize=self.renormalize, scaling=self.scaling)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, method={self.method}, "
                f"groups={self.topk_group}/{self.n_group}")


class DeepseekMoE(nn.Module):
    def __init__(self, config, prefix: str, ctx: ModelContext) -> None:
        super().__init__()
        self.tp = ctx.tp
        self.gate = DeepseekRouter(config)
        self.experts = FusedMoE(f"{prefix}.experts", config.n_routed_experts,
                                config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False,
                                dtype=ctx.dtype, ops=ctx.ops, tp=ctx.tp,
                                expert_parallel=ctx.enable_expert_parallel)
        shared = getattr(config, "n_shared_experts", 0) or 0
        # its tensor-parallel partial sums join the routed experts' one all-reduce
        self.shared_experts = LlamaMLP(config, f"{prefix}.shared_experts", ctx,
                                       config.moe_intermediate_size * shared,
                                       reduce_results=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts.routed(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """Registered for ``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``; checkpoints
    with per-expert matrices (the Hub's) or transformers 5's stacked ones both load."""

    supports_pp = True
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    supports_kv_layer_hook = False  # the latent cache is not a connector's K/V layout

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model",
                 mla_mode: str | None = None) -> None:
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the DeepSeek "
                             "implementation (only silu)")
        self.mla_mode = mla_mode or ctx.mla
        super().__init__(hf_config, ctx, prefix)
        attn = self.model.layers[self.model.start_layer].self_attn
        spec = attn.kv_cache_spec()
        # the runner's per-layer facts: the expanded form caches every head; the latent one
        # row per token (as one "head" of latent_dim, for code that reads these fields)
        if isinstance(spec, MLASpec):
            self.num_kv_heads, self.head_dim = 1, spec.latent_dim
        else:
            self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self._interleaved = interleaved_rope(hf_config)

    def build_model(self, config, prefix: str, ctx: ModelContext) -> nn.Module:
        # Llama's stack with MLA in every layer; the rope rotates q/k's rope part only
        # (transformers sets config.head_dim = qk_rope_head_dim)
        return LlamaModel(config, prefix, ctx, self.make_mlp,
                          make_attn=lambda p: MLAAttention(config, p, ctx, self.mla_mode),
                          rope_dim=config.qk_rope_head_dim)

    def make_mlp(self, config, prefix: str, ctx: ModelContext,
                 layer_index: int) -> nn.Module | None:
        return DeepseekMoE(config, prefix, ctx) if is_moe_layer(config, layer_index) else None

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        m = self.model  # (the one definition llmkit config and sim read too)
        specs = deepseek_kv_specs(self.config, self.ctx.tp.size, self.mla_mode)
        return specs[m.start_layer:m.end_layer]

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, MLAAttention) and module.mode == "absorbed":
                module.absorb_weights()  # from the dense kv_b_proj, before any repacking
        super().process_weights_after_loading()

    def _checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint as this model holds it: V3's multi-token-prediction layers (past
        ``num_hidden_layers``) dropped, interleaved rope rows de-interleaved."""
        c = self.config
        rope, qk = c.qk_rope_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m and int(m[1]) >= c.num_hidden_layers:
                continue
            if self._interleaved:
                if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
                    tensor = deinterleave_rows(tensor, c.qk_nope_head_dim, qk, rope)
                elif name.endswith((".self_attn.kv_a_proj_with_mqa.weight",
                                    ".self_attn.kv_a_proj_with_mqa.bias")):
                    tensor = deinterleave_rows(tensor, c.kv_lora_rank, tensor.shape[0], rope)
            yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._checkpoint(weights))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same implementation; the config's ``model_type`` selects V3's router and rope."""
