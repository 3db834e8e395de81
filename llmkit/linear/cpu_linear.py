"""The CPU platform's linear method: one layer, three kernels, chosen by the step's row count.

- up to ``dispatch.linear_small_batch_max_rows`` rows (decoding a few sequences): llmkit's C++
  small-batch linear (``torch.ops.llmkit_cpu.linear``), which streams the weight once in its
  own dtype and sums each row in torch's GEMV order, so a row's bits do not depend on its batch;
- up to ``dispatch.linear_packed_max_rows``: oneDNN's GEMM on a packed (blocked) copy of the
  weight, faster than MKL on the plain layout for decoding-sized batches;
- beyond (prefill-sized batches): MKL on the plain weight, ~10% faster there.

bf16 weights are packed too where the tier computes bf16 natively (``pack_bf16``: AVX512-BF16,
AMX): oneDNN's bf16 GEMM on the plain weight reorders it into its blocked layout on every call
(the whole LM head at every decode step); the packed copy is reordered once. Both run the same
oneDNN kernel on the same blocks, so they give the same bits for the same batch.

In the amx tier (``bf16_tiles``) bf16 layers of up to ``linear_packed_max_rows`` rows, one
decode row included, run llmkit's AMX-BF16 tile linear (``kernels/cpu/amx_bf16_linear.h``) on
a copy of the weight repacked once in tile order: a row's bits do not depend on how many rows
share its step (oneDNN's do), and it streams the weight faster than oneDNN and the C++ linear
at decode batches. Past those rows (prefill) oneDNN's bf16 GEMM on the plain weight.

With ``widen_bf16`` (bf16 models on CPUs without native bf16, where torch emulates bf16 GEMMs
5-8x slower than float32) the GEMM paths keep a float32 copy of the bf16 weight (exact: every
bf16 value is a float32 value), widen the input and round the output back to bf16: the same
products as a bf16 GEMM with float32 accumulation, in another order. One row without the C++
kernel stays on torch's bf16 GEMV, which reads half the bytes.

The crossovers are the platform's dispatch table (``llmkit.config.cpu_dispatch``), handed to
the method by the platform; the paths give different bits, so they are fixed per instruction-set
tier, never timed at start-up. The defaults were measured on this project's 2-core AVX2 machine
(``benchmarks/test_linear_methods_bench.py`` prints every path at each row count).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.linear.base import LinearMethod


class CpuLinearMethod(LinearMethod):
    name = "cpu"

    def __init__(self, kernels=None, *, pack: bool = True, widen_bf16: bool = False,
                 pack_bf16: bool = False, bf16_tiles: bool = False,
                 dispatch: CpuDispatch | None = None) -> None:
        self.kernels = kernels  # torch.ops.llmkit_cpu, or None
        dispatch = dispatch if dispatch is not None else CpuDispatch()
        #: Rows up to which the C++ small-batch linear runs.
        self.small_batch_max_rows = dispatch.linear_small_batch_max_rows
        #: Rows up to which the packed oneDNN weight is used (MKL on the plain one above).
        self.packed_max_rows = dispatch.linear_packed_max_rows
        self.pack = pack
        #: bf16 weights get a packed oneDNN copy too (only where oneDNN computes bf16 natively).
        self.pack_bf16 = pack_bf16
        self.widen_bf16 = widen_bf16
        #: bf16 weights run the AMX tile linear (the amx tier's kernels only).
        self.bf16_tiles = bf16_tiles
        self.tile_weight: torch.Tensor | None = None
        self.packed_weight: torch.Tensor | None = None
        # widen_bf16: float32 copies of weight and bias for the GEMM paths
        self.weight_float32: torch.Tensor | None = None
        self.bias_float32: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach()
        if self.bf16_tiles and self.kernels is not None and w.dtype == torch.bfloat16:
            # instead of oneDNN's packed copy: one extra copy of the weight, not two
            self.tile_weight = self.kernels.bf16_tile_pack(w)
            return
        widen = self.widen_bf16 and w.dtype == torch.bfloat16
        if widen:
            w = self.weight_float32 = w.float()
            if layer.bias is not None:
                self.bias_float32 = layer.bias.detach().float()
        else:
            self.widen_bf16 = False
        packable = w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and self.pack_bf16)
        if self.pack and packable and torch.backends.mkldnn.is_available():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        weight = layer.weight
        if self.tile_weight is not None and x.dtype == torch.bfloat16:
            if rows <= self.packed_max_rows:
                return self.kernels.bf16_tile_linear(x, self.tile_weight, weight.shape[0],
                                                     layer.bias)
            return F.linear(x, weight, layer.bias)
        if (self.kernels is not None and rows <= self.small_batch_max_rows
                and x.dtype == weight.dtype):
            return self.kernels.linear(x, weight, layer.bias)
        if not self.widen_bf16:
            if self.packed_weight is not None and rows <= self.packed_max_rows:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, layer.bias,
                                                          "none", [], "")
            return F.linear(x, weight, layer.bias)
        if rows == 1:
            return F.linear(x, weight, layer.bias)
        xf = x.float()
        if self.packed_weight is not None and rows <= self.packed_max_rows:
            y = torch.ops.mkldnn._linear_pointwise(xf, self.packed_weight, self.bias_float32,
                                                   "none", [], "")
        else:
            y = F.linear(xf, self.weight_float32, self.bias_float32)
        return y.to(x.dtype)

    @property
    def graph_max_rows(self) -> int | None:
        # the paths switch at these row counts (the C++ kernels' own rows: any bits they give
        # are the same call in a graph)
        if self.tile_weight is not None:
            return self.packed_max_rows
        if self.kernels is not None:
            return self.small_batch_max_rows
        return None

    def describe(self) -> str:
        parts = [self.name]
        if self.tile_weight is not None:
            return f"{self.name}+amx-bf16<={self.packed_max_rows}"
        if self.kernels is not None:
            parts.append(f"c++<={self.small_batch_max_rows}")
        if self.packed_weight is not None:
            parts.append(f"onednn<={self.packed_max_rows}")
        if self.widen_bf16:
            parts.append("bf16-in-float32")
        return "+".join(parts)
