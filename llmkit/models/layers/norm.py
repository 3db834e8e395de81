"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from llmkit.ops.base import ModelOps


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual: ``residual += x; return norm(residual), residual``.

    The residual stream is updated in place: it must be a tensor the caller owns (the model's
    own activations), never an input it was handed.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the scale is ``1 + w``, applied in
    float32 before the cast back (Hugging Face's ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``; Llama's
    casts first, then scales)."""

    def _scale(self) -> torch.Tensor:
        return self.weight.float() + 1.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual.add_(x)
            x = residual
        if x.dtype == torch.float32:
            out = self.ops.rms_norm(x, self._scale(), self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = (h * self._scale()).to(x.dtype)
        return out if residual is None else (out, residual)
