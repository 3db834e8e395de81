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
    """``y = x W^T + b``."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


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
