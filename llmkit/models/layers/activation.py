"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d`` (the output of a fused
    gate/up projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = None  # torch.ops.llmkit_cpu, when the platform provides them

    def use_native_kernels(self, kernels) -> None:
        """Compute with the C++ CPU kernel (``llmkit.kernels.cpu_native``), same roundings."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])
