"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from llmkit.ops.base import ModelOps


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d`` (the output of a fused
    gate/up projection)."""

    def __init__(self, ops: ModelOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
