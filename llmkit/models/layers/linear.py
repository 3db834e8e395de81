"""Linear layers whose parameters come from a checkpoint (allocated, never initialised).

``MergedLinear`` computes several projections of the same input as one matmul (q/k/v, or gate/up):
its weight is the row-wise concatenation of theirs, filled shard by shard at load time.
"""
from __future__ import annotations

from typing import Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), checking the shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"weight {name or '?'}: checkpoint shape {tuple(loaded.shape)} does not "
                         f"match the model's {tuple(param.shape)}")
    param.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T + b``.

    After loading, ``pack_weight()`` may add oneDNN's blocked copy of the weight (CPUs): its
    GEMMs read that layout faster than MKL reads the plain one for the small and mid-sized
    batches of decoding (measured on this project's 2-core AVX2 machine: +20% over a whole
    step's linears at 64 rows, 2x for the 49k-row output layer at one row), while MKL on the
    plain weight stays ~10% faster for prefill-sized batches (2,048 rows). Both are kept, at the
    cost of a second copy of the weights, and each call takes the faster one.

    ``pack_weight(compute_in_float32=True)`` is for bfloat16 models on CPUs without native bf16
    (AVX2 only), where torch emulates bf16 GEMMs 5-8x slower than float32 ones: a float32 copy
    of the weight is added (exactly: every bf16 value is a float32 value), inputs are widened,
    and the output is rounded back to bf16. A bf16 GEMM multiplies the same bf16 values and
    accumulates in float32 too, so only the summation order differs; the rest of the model
    stays bf16. One row (batch-1 decoding) still goes through torch's bf16 GEMV on the bf16
    weight: it accumulates in float32 and reads half the bytes, which is what bounds one row
    (all of SmolLM2-135M's linears at one row: 18.7 ms vs 27.2 ms packed float32 on the 2-core
    AVX2 machine; from two rows on it loses).
    """

    # Rows up to which the packed weight is used (the measured crossover).
    packed_max_rows = 512
    # Rows up to which the C++ kernels' linear is used, when the platform provides them (and
    # with them a decode step runs each layer as one call): SmolLM2-135M's bf16 decode step at
    # 4 / 8 rows took 26 / 54 ms that way vs 45 / 74 ms through the packed float32 copies
    # (2-core AVX2 machine); at 16 rows the packed GEMMs are ahead.
    native_max_rows = 8

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.io_dtype: torch.dtype | None = None  # set when computing wider than the model
        # With io_dtype: float32 copies of weight and bias for the GEMMs past one row.
        self.weight_float32: torch.Tensor | None = None
        self.bias_float32: torch.Tensor | None = None
        self.kernels = None  # torch.ops.llmkit_cpu, when the platform provides them

    def use_native_kernels(self, kernels) -> None:
        """Up to ``native_max_rows`` rows (decoding at small batches) through the C++ kernel,
        which streams the weight once in its own dtype (a whole model's weights at one row:
        ~21 GB/s in bf16 and 21-25 GB/s in float32 on the 2-core AVX2 machine, vs ~14 GB/s
        for torch's GEMVs); past that oneDNN/MKL keep the work."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernels is not None and x.shape[0] <= self.native_max_rows
                and x.dtype == self.weight.dtype):
            return self.kernels.linear(x, self.weight, self.bias)
        if self.io_dtype is None:
            if self.packed_weight is not None and x.shape[0] <= self.packed_max_rows:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                          "none", [], "")
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        x = x.float()
        if x.shape[0] <= self.packed_max_rows:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias_float32,
                                                   "none", [], "")
        else:
            y = F.linear(x, self.weight_float32, self.bias_float32)
        return y.to(self.io_dtype)

    @torch.no_grad()
    def pack_weight(self, batch_hint: int = 64, compute_in_float32: bool = False) -> None:
        """Add oneDNN's packed copy of the loaded float32 weight (CPU only); with
        ``compute_in_float32``, a bf16 layer first moves to float32 weights and math."""
        w = self.weight.detach()
        if compute_in_float32 and w.dtype == torch.bfloat16:
            self.io_dtype = w.dtype
            w = self.weight_float32 = w.float()
            if self.bias is not None:
                self.bias_float32 = self.bias.detach().float()
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"packed linear weights need float32 on the CPU, not "
                             f"{w.dtype} on {w.device}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
                f"{', packed' if self.packed_weight is not None else ''}"
                f"{', float32 math' if self.io_dtype is not None else ''}")


class MergedLinear(Linear):
    """Several linear maps of one input in one matmul; the output concatenates theirs in the
    order of ``output_sizes`` (shard id -> rows)."""

    def __init__(self, in_features: int, output_sizes: Mapping[Hashable, int], bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias, dtype)
        self.shards: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shards[shard_id] = (offset, size)
            offset += size

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable,
                   name: str = "") -> None:
        offset, size = self.shards[shard_id]
        copy_weight(param.narrow(0, offset, size), loaded, name)
