"""The linear-method seam: *how* a linear layer stores its weight and multiplies by it.

A model declares *what* each linear layer is (a :class:`LinearSpec`: its shape, its shards, its
role in tensor parallelism, the checkpoint's storage of its weight); the platform picks a
:class:`LinearMethod` for it when the model is built, and the layer delegates everything to that
method: creating its parameters, loading checkpoint shards into them, preparing them after
loading (packing, repacking, quantizing) and applying the layer. vLLM's quant-method idea.

Methods added later wrap or replace these without touching the model: quantized block formats,
a LoRA wrapper (adds each row's adapter delta), column/row-parallel methods (slice at load,
all-reduce after a row-parallel apply).
"""
from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Hashable, Literal

import torch
from torch import nn

#: How a layer is split over tensor-parallel ranks: not at all, by output rows (column
#: parallel: q/k/v, gate/up), or by input columns (row parallel: o, down; all-reduce after).
ParallelKind = Literal["replicated", "column", "row"]

#: ``LinearMethod.graph_max_rows`` of a method that takes one path at every row count.
ANY_ROWS = sys.maxsize


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """A linear layer as its model declares it: ``y = x W^T + b``, ``W [out, in]``.

    ``output_sizes`` lists the rows of each shard of a merged layer in output order (q, k, v
    or gate, up) with the checkpoint's shard ids in ``shard_ids``; a plain layer has one shard
    whose id is ``None``. ``weight_format`` is how the checkpoint stores this layer's weight
    (the loader's plan, e.g. a GGUF block type); ``None`` means plain floating point.
    """

    prefix: str
    in_features: int
    output_sizes: tuple[int, ...]
    shard_ids: tuple[Hashable, ...] = (None,)
    bias: bool = False
    dtype: torch.dtype = torch.float32
    parallel: ParallelKind = "replicated"
    weight_format: object | None = None
    #: Tensor parallel: the indivisible units of each shard (attention heads of q, k, v;
    #: ``None`` = rows). A column-parallel shard of ``u`` units splits into ``min(tp, u)``
    #: parts, so K/V heads fewer than the ranks are replicated.
    shard_units: tuple[int, ...] | None = None
    #: Tensor parallel: a column-parallel layer whose whole output is consumed (the LM head)
    #: gathers every rank's columns after the matmul.
    gather_output: bool = False
    #: Tensor parallel: a row-parallel layer whose partial sums the caller adds into a larger
    #: sum before one all-reduce (a MoE block's shared expert) leaves them unreduced.
    reduce_results: bool = True

    def __post_init__(self) -> None:
        if len(self.output_sizes) != len(self.shard_ids):
            raise ValueError(f"{self.prefix}: {len(self.output_sizes)} output sizes but "
                             f"{len(self.shard_ids)} shard ids")
        if self.shard_units is not None and len(self.shard_units) != len(self.output_sizes):
            raise ValueError(f"{self.prefix}: {len(self.output_sizes)} output sizes but "
                             f"{len(self.shard_units)} shard units")

    @property
    def out_features(self) -> int:
        return sum(self.output_sizes)

    def shard_rows(self, shard_id: Hashable) -> tuple[int, int]:
        """``(offset, rows)`` of a shard in the output."""
        offset = 0
        for sid, size in zip(self.shard_ids, self.output_sizes):
            if sid == shard_id:
                return offset, size
            offset += size
        raise KeyError(f"{self.prefix}: no shard {shard_id!r} (shards: {self.shard_ids})")


class LinearMethod(ABC):
    """Creates a layer's parameters, loads checkpoint tensors into them and applies the layer.

    The default parameter layout is a dense ``weight [out, in]`` (and ``bias [out]``) in the
    model's dtype, filled shard by shard; methods that store weights otherwise override
    :meth:`create_weights` and :meth:`load_weight`. Every method is one object per layer, so it
    may keep per-layer state (packed copies, scales).
    """

    #: A short name for logs and ``describe()``.
    name: str = "base"
    #: The embedding module a tied LM head shares its weight with (set by the model); methods
    #: that keep weights packed read the embedding's packed rows from it.
    tied_embedding: nn.Module | None = None
    #: Whether LoRA may wrap this method (``llmkit.lora.layers``); a method whose weights the
    #: LoRA path cannot read next to its own says False.
    supports_lora: bool = True

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        layer.weight = nn.Parameter(torch.empty(spec.out_features, spec.in_features,
                                                dtype=spec.dtype), requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(spec.out_features, dtype=spec.dtype),
                                   requires_grad=False) if spec.bias else None)

    def expected_weights(self, spec: LinearSpec) -> set[tuple[str, Hashable]]:
        """The ``(checkpoint name, shard id)`` pairs a complete checkpoint provides."""
        names = ("weight", "bias") if spec.bias else ("weight",)
        return {(n, s) for n in names for s in spec.shard_ids}

    def load_weight(self, layer: nn.Module, spec: LinearSpec, name: str, loaded: torch.Tensor,
                    shard_id: Hashable) -> None:
        """Copy the checkpoint tensor ``<prefix>.<name>`` (``weight`` or ``bias``) of shard
        ``shard_id`` into the layer's parameters."""
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"checkpoint weight {spec.prefix}.{name} has no counterpart in the "
                             "model")
        offset, rows = spec.shard_rows(shard_id)
        target = param if len(spec.shard_ids) == 1 else param.narrow(0, offset, rows)
        copy_weight(target, loaded, f"{spec.prefix}.{name}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After every weight is loaded: repack, quantize or add copies here."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, in] -> [rows, out]`` in ``x``'s dtype."""

    def describe(self) -> str:
        return self.name

    @property
    def graph_max_rows(self) -> int | None:
        """Rows up to which :meth:`apply` takes one path (one opaque kernel) whatever the row
        count, so that a step graph dynamic in its rows traces that path and computes eager's
        bits up to here; ``ANY_ROWS``: at every count. None: the method does not say (the
        platform keeps its own bound for such layers)."""
        return None


#: What a platform hands a model: the method for each linear layer it declares.
LinearMethodFactory = Callable[[LinearSpec], LinearMethod]


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), checking the shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"weight {name or '?'}: checkpoint shape {tuple(loaded.shape)} does not "
                         f"match the model's {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)
