"""Tensor-parallel linear methods: wrappers around any platform method (vLLM's
Column/RowParallelLinear, here at the linear-method seam so that the model declares each layer
once and the parallel split composes with every method, quantized ones included).

- column parallel (q/k/v, gate/up, the LM head): each rank holds a slice of every output shard's
  rows; no communication, except the LM head, which gathers its columns (``gather_output``);
- row parallel (o, down): each rank holds a slice of the input columns; the partial products
  are summed by one all-reduce. The bias is added once: rank 0 holds it, the others zeros.

The wrapped method sees the rank's *local* spec, so it creates, packs and applies a plain
smaller layer. Checkpoint tensors arrive whole and are sliced here at load.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

import torch
from torch import nn

from llmkit.distributed.group import TensorParallelGroup
from llmkit.linear.base import LinearMethod, LinearMethodFactory, LinearSpec


def _column_parts(spec: LinearSpec, tp: TensorParallelGroup) -> list[tuple[int, int, int]]:
    """Per output shard: ``(rows per part, start row in the checkpoint shard, rows held)``;
    a shard whose rows do not divide (a vocabulary) gets its last part padded with zeros."""
    units = spec.shard_units or spec.output_sizes
    out = []
    for size, u in zip(spec.output_sizes, units):
        parts, part = tp.partition(u)
        local = -(-size // parts)
        start = part * local
        out.append((local, start, max(0, min(size, start + local) - start)))
    return out


def local_spec(spec: LinearSpec, tp: TensorParallelGroup) -> LinearSpec:
    """The part of ``spec`` one rank holds."""
    if spec.parallel == "column":
        sizes = tuple(local for local, _, _ in _column_parts(spec, tp))
        return dataclasses.replace(spec, output_sizes=sizes, shard_units=None)
    if spec.parallel == "row":
        if spec.in_features % tp.size:
            raise ValueError(f"{spec.prefix}: {spec.in_features} input features do not split "
                             f"over {tp.size} tensor-parallel ranks")
        return dataclasses.replace(spec, in_features=spec.in_features // tp.size)
    return spec


class _ParallelLinearMethod(LinearMethod):
    def __init__(self, inner: LinearMethod, local: LinearSpec, tp: TensorParallelGroup) -> None:
        self.inner = inner
        self.local = local
        self.tp = tp
        self.name = f"{self.kind}-parallel({inner.name})"

    kind = "?"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        self.inner.create_weights(layer, self.local)

    def expected_weights(self, spec: LinearSpec) -> set[tuple[str, Hashable]]:
        return self.inner.expected_weights(self.local)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def describe(self) -> str:
        return f"{self.kind}-parallel[{self.tp.rank}/{self.tp.size}]({self.inner.describe()})"

    @property
    def graph_max_rows(self) -> int | None:
        return self.inner.graph_max_rows


class ColumnParallelLinearMethod(_ParallelLinearMethod):
    kind = "column"

    def __init__(self, inner: LinearMethod, local: LinearSpec, full: LinearSpec,
                 tp: TensorParallelGroup) -> None:
        super().__init__(inner, local, tp)
        self.full = full
        self.parts = dict(zip(full.shard_ids, _column_parts(full, tp)))

    def load_weight(self, layer: nn.Module, spec: LinearSpec, name: str, loaded: torch.Tensor,
                    shard_id: Hashable) -> None:
        local, start, held = self.parts[shard_id]
        piece = loaded.narrow(0, start, held)
        if held < local:  # the padded tail of a vocabulary
            pad = loaded.new_zeros((local - held, *loaded.shape[1:]))
            piece = torch.cat([piece, pad])
        self.inner.load_weight(layer, self.local, name, piece, shard_id)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.apply(layer, x)
        if self.full.gather_output:
            y = self.tp.all_gather(y)[..., :self.full.out_features]
        return y


class RowParallelLinearMethod(_ParallelLinearMethod):
    kind = "row"

    def load_weight(self, layer: nn.Module, spec: LinearSpec, name: str, loaded: torch.Tensor,
                    shard_id: Hashable) -> None:
        if name == "bias":
            piece = loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
        else:
            cols = self.local.in_features
            piece = loaded.narrow(-1, self.tp.rank * cols, cols)
        self.inner.load_weight(layer, self.local, name, piece, shard_id)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.apply(layer, x)
        return self.tp.all_reduce(y) if self.local.reduce_results else y


def tensor_parallel_factory(inner: LinearMethodFactory,
                            tp: TensorParallelGroup) -> LinearMethodFactory:
    """``inner``'s methods, split over ``tp`` for the layers the model marks column or row
    parallel (replicated layers, and everything at ``tp.size == 1``, are ``inner``'s own)."""
    if tp.size == 1:
        return inner

    def make(spec: LinearSpec) -> LinearMethod:
        if spec.parallel == "replicated":
            return inner(spec)
        if spec.weight_format is not None:
            raise ValueError(f"{spec.prefix}: tensor parallel needs plain floating-point "
                             "checkpoint weights (a GGUF's quantized blocks are not split yet)")
        local = local_spec(spec, tp)
        if spec.parallel == "column":
            return ColumnParallelLinearMethod(inner(local), local, spec, tp)
        return RowParallelLinearMethod(inner(local), local, tp)

    return make
