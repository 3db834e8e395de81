"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
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


class GeluTanhAndMul(nn.Module):
    """GeGLU: ``gelu_tanh(x[..., :d]) * x[..., d:]`` (Gemma's ``gelu_pytorch_tanh`` gate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])
