"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in float32, cast back, then scale by ``weight``."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
    h = h.mul_(scale) if h.data_ptr() != x.data_ptr() else h * scale
    return h.to(x.dtype).mul_(weight)


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual: ``residual += x; return norm(residual), residual``.

    The residual stream is updated in place: it must be a tensor the caller owns (the model's
    own activations), never an input it was handed.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.kernels = None  # torch.ops.llmkit_cpu, when the platform provides them

    def use_native_kernels(self, kernels) -> None:
        """Compute with the C++ CPU kernels (``llmkit.kernels.cpu_native``): one call instead
        of eight ops, the same roundings."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernels is not None and x.dim() == 2:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        residual.add_(x)
        return rms_norm(residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
