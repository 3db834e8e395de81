"""The routed experts of a sparse MoE block (vLLM's ``FusedMoE``): every expert's gate and up
matrices stacked into ``w13_weight [E_local, 2 * I_local, H]`` and its down matrix into
``w2_weight [E_local, H, I_local]`` at load time, computed by the platform's ``fused_moe`` op.

Over ``tp.size`` ranks the experts split one of two ways, both ending in the caller's single
all-reduce of this layer's partial output:

- tensor parallel (the default): every rank holds every expert, each expert's intermediate
  dimension split like a column/row-parallel MLP (``I_local = I / tp``);
- expert parallel (``parallel.enable_expert_parallel``): rank ``r`` holds ``E / tp`` whole
  experts, ``r * E / tp ...``, and computes only the (token, choice) pairs routed to them
  (``expert_map``: global id -> local id, -1 elsewhere).
"""
from __future__ import annotations

import torch
from torch import nn

from llmkit.distributed.group import TensorParallelGroup
from llmkit.linear.base import copy_weight
from llmkit.ops.base import ModelOps

#: Checkpoint shard ids of an expert (vLLM's): ``w1`` gate, ``w3`` up, ``w2`` down.
EXPERT_SHARDS = ("w1", "w3", "w2")


class FusedMoE(nn.Module):
    def __init__(self, prefix: str, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, *, renormalize: bool, dtype: torch.dtype,
                 ops: ModelOps, tp: TensorParallelGroup = TensorParallelGroup(),
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.ops = ops
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"{prefix}: {num_experts} experts do not split over "
                                 f"{tp.size} expert-parallel ranks")
            self.num_local = num_experts // tp.size
            self.expert_start = tp.rank * self.num_local
            self.inter, self.inter_start = intermediate_size, 0
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.expert_start:self.expert_start + self.num_local] = torch.arange(
                self.num_local, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"{prefix}: the experts' intermediate size {intermediate_size} "
                                 f"does not split over {tp.size} tensor-parallel ranks")
            self.num_local, self.expert_start = num_experts, 0
            self.inter = intermediate_size // tp.size
            self.inter_start = tp.rank * self.inter
            self.expert_map = None
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter, hidden_size, dtype=dtype),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, hidden_size, self.inter, dtype=dtype),
            requires_grad=False)

    def expected_weights(self) -> set[tuple[int, str]]:
        """``(expert id, shard id)`` of every expert matrix a complete checkpoint provides."""
        return {(e, s) for e in range(self.num_experts) for s in EXPERT_SHARDS}

    def load_expert_weight(self, expert_id: int, shard_id: str, loaded: torch.Tensor) -> None:
        """Copy the checkpoint's ``[I, H]`` gate (``w1``) or up (``w3``) or ``[H, I]`` down
        (``w2``) matrix of global expert ``expert_id`` into this rank's stack; another rank's
        expert is skipped."""
        name = f"{self.prefix}.{expert_id}.{shard_id}"
        if not 0 <= expert_id < self.num_experts or shard_id not in EXPERT_SHARDS:
            raise ValueError(f"checkpoint weight {name} has no counterpart in the model "
                             f"({self.num_experts} experts)")
        full = ((self.hidden_size, self.intermediate_size) if shard_id == "w2"
                else (self.intermediate_size, self.hidden_size))
        if tuple(loaded.shape) != full:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {full}")
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local:
            return
        if shard_id == "w2":
            copy_weight(self.w2_weight[local], loaded.narrow(1, self.inter_start, self.inter),
                        name)
            return
        rows = self.w13_weight[local].narrow(0, 0 if shard_id == "w1" else self.inter,
                                             self.inter)
        copy_weight(rows, loaded.narrow(0, self.inter_start, self.inter), name)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` and the router's ``[T, E]`` logits -> this rank's part of the experts'
        output (the caller all-reduces)."""
        weights, ids = self.ops.moe_topk(router_logits, self.top_k, self.renormalize)
        return self.routed(x, weights, ids)

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output for a choice made elsewhere (a model's own router, e.g.
        DeepSeek's grouped ones): ``topk_weights`` float32 and ``topk_ids`` ``[T, k]``."""
        return self.ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                  self.expert_map)

    def describe(self) -> str:
        """How this rank computes the experts (listed beside the linear methods)."""
        if self.expert_parallel:
            split = f"expert-parallel[{self.expert_start // self.num_local}/" \
                    f"{self.num_experts // self.num_local}]"
        elif self.inter != self.intermediate_size:
            split = f"tensor-parallel[{self.inter_start // self.inter}/" \
                    f"{self.intermediate_size // self.inter}]"
        else:
            split = "whole"
        return f"fused-moe-{split}({self.ops.name})"

    def extra_repr(self) -> str:
        split = (f", experts {self.expert_start}..{self.expert_start + self.num_local}"
                 if self.expert_parallel else
                 f", intermediate {self.inter_start}..{self.inter_start + self.inter}"
                 if self.inter != self.intermediate_size else "")
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}{split}")
