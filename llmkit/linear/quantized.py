"""The quantized linear method: weights kept packed (GGUF blocks, int8, fp8), multiplied by
``torch.ops.llmkit_cpu.quant_linear`` (``kernels/cpu/quant_*.h``).

``model.quantization`` (API.md) picks what the loader hands over:

- ``gguf``: a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors arrive as :class:`GGUFRows` (the
  file's raw rows, never dequantized); a merged layer's shards (q|k|v, gate|up) are stacked as
  raw rows and repacked once, so their row counts need not be multiples of the kernel's 8-row
  groups. Shards of different kept types (a Q4_K_M file's Q6_K ``v``) are packed one by one and
  their outputs concatenated. A layer with any float shard (F16/F32, or a GGUF type that was
  dequantized at load) runs the platform's float method on the dequantized whole.
- ``int8`` / ``fp8``: float checkpoint tensors quantized per output channel after loading (the
  shards stacked first: per-row scales make that the same as quantizing each). The LM head
  stays in float there (vLLM's default: the head is the most sensitive layer).

The integer formats quantize the activations to 8 bits per 32-input block inside the kernel
(llama.cpp's scheme); the tied LM head of a GGUF (SmolLM2's Q8_0 embedding) multiplies with
the embedding's packed rows, which the embedding also reads back for its lookups.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Hashable, Literal

import torch
from torch import nn

from llmkit.kernels.quant import weights as qweights
from llmkit.kernels.quant.formats import dequantize_gguf
from llmkit.linear.base import ANY_ROWS, LinearMethod, LinearMethodFactory, LinearSpec

logger = logging.getLogger(__name__)

#: ``model.quantization`` once resolved against the checkpoint (``auto`` is gone by then).
QuantizationMode = Literal["none", "gguf", "int8", "fp8"]


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFRows:
    """A GGUF tensor kept in its blocks: uint8 ``raw [rows, row_bytes]`` of format ``fmt``
    (``llmkit.kernels.quant.formats.FORMATS``), ``in_features`` values per row."""

    raw: torch.Tensor
    fmt: str
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.in_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize_gguf(self.raw, self.fmt, self.in_features)

    def pack(self) -> qweights.PackedWeight:
        return qweights.pack_gguf(self.raw, self.fmt, self.in_features)


def as_float(loaded: torch.Tensor | GGUFRows) -> torch.Tensor:
    return loaded.dequantize() if isinstance(loaded, GGUFRows) else loaded


class QuantizedLinearMethod(LinearMethod):
    name = "quantized"

    def __init__(self, mode: QuantizationMode, float_method: LinearMethod, kernels) -> None:
        if mode not in ("gguf", "int8", "fp8"):
            raise ValueError(f"QuantizedLinearMethod: mode {mode!r} (gguf, int8, fp8)")
        self.mode = mode
        self.float_method = float_method  # the platform's method, for layers left in float
        self._quant_linear = kernels.quant_linear  # torch.ops.llmkit_cpu.quant_linear
        self.packed: list[qweights.PackedWeight] = []  # one, or one per shard (mixed types)
        self.use_float = False
        #: The embedding this layer shares its weight with (a tied LM head), if any.
        self.tied_embedding = None
        self._parts: dict[Hashable, torch.Tensor | GGUFRows] = {}
        self._spec: LinearSpec | None = None

    # -- parameters --------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        # No dense weight: shards are held as loaded until process_weights_after_loading.
        self._spec = spec
        layer.register_parameter("weight", None)
        layer.bias = (nn.Parameter(torch.empty(spec.out_features, dtype=spec.dtype),
                                   requires_grad=False) if spec.bias else None)

    def load_weight(self, layer: nn.Module, spec: LinearSpec, name: str,
                    loaded: torch.Tensor | GGUFRows, shard_id: Hashable) -> None:
        if name != "weight":
            return super().load_weight(layer, spec, name, as_float(loaded), shard_id)
        _, rows = spec.shard_rows(shard_id)
        if tuple(loaded.shape) != (rows, spec.in_features):
            raise ValueError(f"weight {spec.prefix}.weight[{shard_id}]: checkpoint shape "
                             f"{tuple(loaded.shape)} does not match the model's "
                             f"{(rows, spec.in_features)}")
        self._parts[shard_id] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec = self._spec
        if self.tied_embedding is not None:
            packed = getattr(self.tied_embedding, "packed", None)
            if packed is not None:
                self.packed = [packed]
                return
            return self._to_float(layer, None)  # layer.weight is the embedding's
        parts = [self._parts[s] for s in spec.shard_ids]
        self._parts = {}
        blocks = [p for p in parts if isinstance(p, GGUFRows)]
        if len(blocks) == len(parts):
            if len({p.fmt for p in parts}) == 1:
                raw = parts[0].raw if len(parts) == 1 else torch.cat([p.raw for p in parts])
                self.packed = [GGUFRows(raw, parts[0].fmt, spec.in_features).pack()]
            else:
                self.packed = [p.pack() for p in parts]
        elif not blocks and self.mode in ("int8", "fp8") and spec.prefix != "lm_head":
            w = parts[0] if len(parts) == 1 else torch.cat(parts)
            quantize = qweights.quantize_int8 if self.mode == "int8" else qweights.quantize_fp8
            self.packed = [quantize(w)]
        else:
            self._to_float(layer, parts)

    def _to_float(self, layer: nn.Module, parts: list | None) -> None:
        """Run this layer on the platform's float method (dense weight in the model's dtype)."""
        self.use_float = True
        if parts is not None:
            w = torch.cat([as_float(p) for p in parts]) if len(parts) > 1 else as_float(parts[0])
            layer.weight = nn.Parameter(w.to(self._spec.dtype), requires_grad=False)
        self.float_method.process_weights_after_loading(layer)

    # -- compute -----------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.use_float:
            return self.float_method.apply(layer, x)
        x = x.contiguous()
        if len(self.packed) == 1:
            w = self.packed[0]
            return self._quant_linear(x, w.data, w.format, w.out_features, w.scales, layer.bias,
                                      False, False)
        ys = [self._quant_linear(x, w.data, w.format, w.out_features, w.scales, None, False,
                                 False) for w in self.packed]
        y = torch.cat(ys, dim=-1)
        return y if layer.bias is None else y + layer.bias

    @property
    def graph_max_rows(self) -> int | None:
        # quant_linear at every row count (its VNNI / AMX choice is inside the op)
        return self.float_method.graph_max_rows if self.use_float else ANY_ROWS

    def describe(self) -> str:
        if self.use_float:
            return f"{self.float_method.describe()}(float in {self.mode})"
        return f"{self.name}:{'+'.join(w.format for w in self.packed) or self.mode}"

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.packed)


def quantized_method_factory(mode: QuantizationMode, float_factory: LinearMethodFactory,
                             kernels) -> LinearMethodFactory:
    """Every linear layer gets a :class:`QuantizedLinearMethod` that falls back to
    ``float_factory``'s method for the layers the checkpoint holds in float."""
    return lambda spec: QuantizedLinearMethod(mode, float_factory(spec), kernels)
