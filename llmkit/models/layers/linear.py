"""Linear layers: what the model declares (a ``LinearSpec``), computed by whatever
``LinearMethod`` the platform picked for it (``llmkit/linear/``).

``MergedLinear`` computes several projections of the same input as one matmul (q/k/v, or gate/up):
its output concatenates theirs, and the checkpoint's separate matrices are loaded shard by shard.
"""
from __future__ import annotations

from typing import Hashable, Mapping

import torch
from torch import nn

from llmkit.linear.base import LinearMethod, LinearMethodFactory, LinearSpec, ParallelKind


class Linear(nn.Module):
    """``y = x W^T + b``, delegated to ``self.method``."""

    def __init__(self, spec: LinearSpec, linear_method: LinearMethodFactory) -> None:
        super().__init__()
        self.spec = spec
        self.method: LinearMethod = linear_method(spec)
        self.method.create_weights(self, spec)

    @classmethod
    def build(cls, prefix: str, in_features: int, out_features: int, *, bias: bool,
              dtype: torch.dtype, linear_method: LinearMethodFactory,
              parallel: ParallelKind = "replicated", weight_format: object | None = None,
              gather_output: bool = False, reduce_results: bool = True) -> "Linear":
        spec = LinearSpec(prefix, in_features, (out_features,), (None,), bias, dtype, parallel,
                          weight_format, gather_output=gather_output,
                          reduce_results=reduce_results)
        return cls(spec, linear_method)

    @property
    def in_features(self) -> int:
        return self.spec.in_features

    @property
    def out_features(self) -> int:
        return self.spec.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        self.method.load_weight(self, self.spec, name, loaded, shard_id)

    def expected_weights(self) -> set[tuple[str, Hashable]]:
        return self.method.expected_weights(self.spec)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return (f"in={self.spec.in_features}, out={self.spec.out_features}, "
                f"bias={self.spec.bias}, method={self.method.describe()}")


class MergedLinear(Linear):
    """Several linear maps of one input in one matmul; the output concatenates theirs in the
    order of ``output_sizes`` (shard id -> rows)."""

    def __init__(self, prefix: str, in_features: int, output_sizes: Mapping[Hashable, int], *,
                 bias: bool, dtype: torch.dtype, linear_method: LinearMethodFactory,
                 parallel: ParallelKind = "column", weight_format: object | None = None,
                 shard_units: tuple[int, ...] | None = None) -> None:
        spec = LinearSpec(prefix, in_features, tuple(output_sizes.values()),
                          tuple(output_sizes.keys()), bias, dtype, parallel, weight_format,
                          shard_units)
        super().__init__(spec, linear_method)
