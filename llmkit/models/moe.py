"""The sparse MoE family: Mixtral, Qwen2-MoE (a shared expert behind a sigmoid gate; dense
layers by ``decoder_sparse_step`` / ``mlp_only_layers``) and Qwen3-MoE (per-head q/k norms,
``norm_topk_prob``); ``moe_shape`` also describes DeepSeek's experts (``deepseek.py``).

Llama's attention and decoder layer (``llama.py``) with a sparse MoE block as the MLP: a
router (``gate``), the routed experts (``FusedMoE``: the checkpoint's per-expert matrices
stacked at load) and, for Qwen2-MoE, a shared expert. Under tensor or expert parallel the
block's partial outputs, shared expert included, are summed by one all-reduce.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from llmkit.config.errors import ConfigError
from llmkit.models.base import ModelContext
from llmkit.models.layers.linear import Linear
from llmkit.models.layers.moe import FusedMoE
from llmkit.models.llama import LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True, slots=True)
class MoeShape:
    """What a MoE config says about its experts (the names differ per family)."""

    num_experts: int
    top_k: int
    #: each routed expert's intermediate size
    expert_intermediate_size: int
    #: the shared expert's (Qwen2-MoE), 0 = none
    shared_expert_intermediate_size: int
    #: renormalise the top-k router probabilities to sum to one
    renormalize: bool
    #: the layers whose MLP is a MoE block (the others keep the dense ``intermediate_size``)
    sparse_layers: frozenset[int]


def moe_shape(config) -> MoeShape | None:
    """The experts of a Mixtral / Qwen2-MoE / Qwen3-MoE config; ``None`` for a dense model."""
    layers = range(config.num_hidden_layers)
    if config.model_type == "mixtral":
        return MoeShape(config.num_local_experts, config.num_experts_per_tok,
                        config.intermediate_size, 0, True, frozenset(layers))
    if config.model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = frozenset(i for i in layers if i not in dense and config.num_experts > 0
                           and (i + 1) % step == 0)
        shared = (getattr(config, "shared_expert_intermediate_size", 0) or 0
                  if config.model_type == "qwen2_moe" else 0)
        return MoeShape(config.num_experts, config.num_experts_per_tok,
                        config.moe_intermediate_size, shared, bool(config.norm_topk_prob),
                        sparse)
    if config.model_type in ("deepseek_v2", "deepseek_v3"):
        # MoE from first_k_dense_replace on, every moe_layer_freq-th layer; the shared
        # experts are one MLP of n_shared_experts x moe_intermediate_size (deepseek.py)
        first = getattr(config, "first_k_dense_replace", 0) or 0
        freq = getattr(config, "moe_layer_freq", 1) or 1
        experts = config.n_routed_experts or 0
        sparse = frozenset(i for i in layers if experts and i >= first and i % freq == 0)
        shared = config.moe_intermediate_size * (getattr(config, "n_shared_experts", 0) or 0)
        return MoeShape(experts, config.num_experts_per_tok, config.moe_intermediate_size,
                        shared, bool(getattr(config, "norm_topk_prob", False)), sparse)
    return None


class SparseMoeBlock(nn.Module):
    """Router top-k over the experts, the routed experts' weighted sum, plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` where the model has one."""

    def __init__(self, config, shape: MoeShape, prefix: str, ctx: ModelContext) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.tp = ctx.tp
        self.gate = Linear.build(f"{prefix}.gate", hidden, shape.num_experts, bias=False,
                                 dtype=ctx.dtype, linear_method=ctx.linear_method)
        self.experts = FusedMoE(f"{prefix}.experts", shape.num_experts, shape.top_k, hidden,
                                shape.expert_intermediate_size, renormalize=shape.renormalize,
                                dtype=ctx.dtype, ops=ctx.ops, tp=ctx.tp,
                                expert_parallel=ctx.enable_expert_parallel)
        if shape.shared_expert_intermediate_size:
            # tensor parallel in both modes; its partial sums join the experts' all-reduce
            self.shared_expert = LlamaMLP(config, f"{prefix}.shared_expert", ctx,
                                          shape.shared_expert_intermediate_size,
                                          reduce_results=False)
            self.shared_expert_gate = Linear.build(
                f"{prefix}.shared_expert_gate", hidden, 1, bias=False, dtype=ctx.dtype,
                linear_method=ctx.linear_method)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(y)


# Checkpoint names of expert matrices: one per expert (Mixtral's w1/w2/w3, Qwen's
# gate/up/down_proj), or transformers 5's stacked ``experts.gate_up_proj [E, 2I, H]`` and
# ``experts.down_proj [E, H, I]``.
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                            r"\.weight$")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_SHARD_OF = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2",
             "down_proj": "w2"}


class MoeForCausalLM(LlamaForCausalLM):
    """Registered for ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and
    ``Qwen3MoeForCausalLM``."""

    # Pipeline stages: Llama's (a stage builds and loads only its layers, MoE blocks included).
    supports_pp = True

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model") -> None:
        if ctx.quantization != "none":
            # the linear methods would quantize attention and the router but not the experts,
            # which hold most of the weights
            raise ConfigError("model.quantization", ctx.quantization,
                              "none or auto for a MoE model (its experts are not quantized yet)")
        super().__init__(hf_config, ctx, prefix)

    def make_mlp(self, config, prefix: str, ctx: ModelContext,
                 layer_index: int) -> nn.Module | None:
        shape = moe_shape(config)
        if shape is None:
            raise ValueError(f"model_type {config.model_type!r} is not a MoE architecture")
        if layer_index not in shape.sparse_layers:
            return None  # a dense layer: the gated MLP of intermediate_size
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the MoE implementation "
                             "(only silu)")
        return SparseMoeBlock(config, shape, prefix, ctx)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        seen: set[tuple[str, int, str]] = set()

        def load(prefix: str, expert: int, shard: str, tensor: torch.Tensor) -> None:
            experts[prefix].load_expert_weight(expert, shard, tensor)
            seen.add((prefix, expert, shard))

        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's module name
                m = _EXPERT_WEIGHT.match(name)
                if m and m[1] in experts:
                    load(m[1], int(m[2]), _SHARD_OF[m[3]], tensor)
                    continue
                m = _STACKED_EXPERTS.match(name)
                if m and m[1] in experts:
                    for e in range(tensor.shape[0]):
                        if m[2] == "down_proj":
                            load(m[1], e, "w2", tensor[e])
                        else:
                            gate, up = tensor[e].chunk(2, dim=0)
                            load(m[1], e, "w1", gate)
                            load(m[1], e, "w3", up)
                    continue
                yield name, tensor

        super().load_weights(the_rest())
        expected = {(p, e, s) for p, m in experts.items() for e, s in m.expected_weights()}
        missing = sorted(f"{p}.{e}.{s}" for p, e, s in expected - seen)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} expert weight(s) of the "
                             f"model: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
