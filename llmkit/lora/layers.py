"""LoRA layers: a linear method that wraps any other, and a wrapper of the token embedding.

:class:`LoRALinearMethod` keeps the base method for everything the base layer does (its
parameters, loading, packing, quantized formats, the GEMM itself) and adds, per row, the delta
of the adapter in that row's slot, read from the step's :class:`~llmkit.lora.base.LoRAMapping`.
A fused projection (q/k/v, gate/up) holds one stacked adapter: per slot, the shards' A
matrices side by side and their B matrices one below the other (``punica.StackedLoRA``), so one
shrink serves every shard.

A base method that cannot be wrapped says so with ``supports_lora = False`` (a class
attribute); the model then fails at start-up naming the layer and the method.
"""
from __future__ import annotations

from typing import Hashable

import torch
from torch import nn

from llmkit.config.errors import ConfigError
from llmkit.linear.base import LinearMethod, LinearSpec
from llmkit.lora.base import LoRALayerWeights, LoRAMapping
from llmkit.lora.punica import StackedLoRA, TorchLoRAOps


class LoRALinearMethod(LinearMethod):
    """``base(x) + x A[slot]^T B[slot]^T`` per row; rows without an adapter get ``base(x)``."""

    name = "lora"

    def __init__(self, base: LinearMethod, spec: LinearSpec, *, num_slots: int, max_rank: int,
                 mapping: LoRAMapping, ops: TorchLoRAOps, module_names: tuple[str, ...],
                 on_logits: bool = False) -> None:
        if not base.supports_lora:
            raise ConfigError("model.linear_method", base.describe(), "", message=(
                f"{spec.prefix}: linear method {base.describe()!r} cannot be wrapped by LoRA "
                "(lora.enabled=true needs another model.linear_method, or lora.enabled=false)"))
        self.base = base
        self.spec = spec
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.mapping = mapping
        self.ops = ops
        # PEFT's module name of each shard, in shard order (q_proj, k_proj, v_proj).
        self.module_names = module_names
        # The LM head computes at the rows logits are taken from, not at every token.
        self.on_logits = on_logits
        self.stack: StackedLoRA | None = None

    # -- the base layer: delegated ---------------------------------------------------------
    @property
    def tied_embedding(self) -> nn.Module | None:
        return self.base.tied_embedding

    @tied_embedding.setter
    def tied_embedding(self, embedding: nn.Module | None) -> None:
        # The model ties its LM head to the embedding after building the layer; the base
        # method is the one that computes with (and may keep packed) the shared rows.
        self.base.tied_embedding = embedding

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        self.base.create_weights(layer, spec)
        self.stack = StackedLoRA.empty(self.num_slots, self.max_rank, spec.in_features,
                                       spec.output_sizes, spec.dtype)

    def expected_weights(self, spec: LinearSpec) -> set[tuple[str, Hashable]]:
        return self.base.expected_weights(spec)

    def load_weight(self, layer: nn.Module, spec: LinearSpec, name: str, loaded: torch.Tensor,
                    shard_id: Hashable) -> None:
        self.base.load_weight(layer, spec, name, loaded, shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    # -- slots -----------------------------------------------------------------------------
    def set_slot(self, slot: int, shards: list[LoRALayerWeights | None]) -> None:
        """Write an adapter's weights for this layer into ``slot`` (one entry per shard;
        ``None`` where the adapter does not target that shard)."""
        w = self.stack
        R = self.max_rank
        offs = w.out_offsets
        with torch.no_grad():
            w.a[slot].zero_()
            w.b[slot].zero_()
            ranks = []
            for s, weights in enumerate(shards):
                if weights is None:
                    ranks.append(0)
                    continue
                r = weights.rank
                w.a[slot, s * R:s * R + r] = weights.lora_a
                w.b[slot, :r, offs[s]:offs[s + 1]] = weights.lora_b.T
                ranks.append(r)
        w.set_ranks(slot, ranks)

    # -- compute ---------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        if torch.compiler.is_compiling():
            # Traced into a step graph: no Python state, the slots come as a tensor. Ops that
            # cannot run inside a graph add nothing here; the runner then graphs only steps
            # without adapters (LoRAManager.step_graphs_allowed).
            if self.ops.supports_step_graphs and not self.on_logits:
                self.ops.add_lora_slots(y, x, self.stack,
                                        self.mapping.token_slots[:x.shape[0]])
            return y
        rows = self.mapping.logits if self.on_logits else self.mapping.tokens
        if rows is None:
            return y
        if rows.num_rows != x.shape[0]:
            raise RuntimeError(f"{self.spec.prefix}: the LoRA mapping has {rows.num_rows} rows "
                               f"but the layer got {x.shape[0]} (the runner must set the "
                               "mapping for every forward that computes with adapters)")
        self.ops.add_lora(y, x, self.stack, rows)
        return y

    def describe(self) -> str:
        return f"lora[{self.ops.name}]({self.base.describe()})"

    @property
    def graph_max_rows(self) -> int | None:
        # the LoRA ops switch paths too (the C++ kernel, torch's GEMMs above)
        rows = self.base.graph_max_rows
        limit = getattr(self.ops, "small_batch_max_rows", None)
        return rows if rows is None or limit is None else min(rows, limit)


class LoRAVocabEmbedding(nn.Module):
    """The token embedding plus each token's adapter delta (PEFT's ``lora_embedding_A/B``).
    ``weight`` is the base embedding's (a tied LM head keeps sharing it)."""

    def __init__(self, base: nn.Module, *, num_slots: int, max_rank: int, mapping: LoRAMapping,
                 ops: TorchLoRAOps) -> None:
        super().__init__()
        self.base = base
        self.mapping = mapping
        self.ops = ops
        self.max_rank = max_rank
        # The base's sizes, not its weight's shape: kept GGUF blocks leave the weight empty.
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        with torch.device(base.weight.device):
            self.stack = StackedLoRA.empty(num_slots, max_rank, self.num_embeddings,
                                           (self.embedding_dim,), base.dtype, embedding=True)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        w = self.stack
        with torch.no_grad():
            w.a[slot].zero_()
            w.b[slot].zero_()
            if weights is None:
                w.set_ranks(slot, [0])
                return
            r = weights.rank
            w.a[slot, :, :r] = weights.lora_a.T
            w.b[slot, :r] = weights.lora_b.T
        w.set_ranks(slot, [r])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y = self.base(input_ids)
        if torch.compiler.is_compiling():  # a step graph: the slots as a tensor
            if self.ops.supports_step_graphs:
                self.ops.add_embedding_lora_slots(y, input_ids, self.stack,
                                                  self.mapping.token_slots[:input_ids.shape[0]])
            return y
        rows = self.mapping.tokens
        if rows is None:
            return y
        if rows.num_rows != input_ids.shape[0]:
            raise RuntimeError(f"embedding: the LoRA mapping has {rows.num_rows} rows but "
                               f"{input_ids.shape[0]} tokens were embedded")
        self.ops.add_embedding_lora(y, input_ids, self.stack, rows)
        return y

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, lora slots={self.stack.a.shape[0]}"
