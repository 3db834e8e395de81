"""Fused RMSNorm: ``rms_norm(x, w)`` and ``fused_add_rms_norm(x, residual, w)``, which adds the
residual and normalises in one pass over the row (one HBM read of each input, one write of each
output) and returns both ``(norm(x + residual) * w, x + residual)``.

Numerics follow Hugging Face's RMSNorm (and ``llmkit.models.layers.norm``): the sum is taken in
float32, the normalised row is cast to the input dtype, then multiplied by the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    num_rows, hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    r_ok = rows < num_rows
    c_ok = cols < hidden
    mask = r_ok[:, None] & c_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's dtype
        tl.store(res_out_ptr + rows64[:, None] * stride_ro + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 1) / hidden
    h = h * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0)
    y = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _launch(x, residual, weight, eps, out, res_out):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    block_c = next_power_of_2(hidden)
    block_r = max(1, min(next_power_of_2(num_rows), 4096 // block_c))
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    ro2 = res_out.reshape(-1, hidden) if res_out is not None else x2
    o2 = out.view(-1, hidden)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x2, r2, weight, o2, ro2, num_rows, hidden, float(eps),
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_C=block_c,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, into a new tensor of ``x``'s dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in place, like ``llmkit.models.layers.RMSNorm``), then return
    ``(rms_norm(residual) * weight, residual)``; one kernel, one pass."""
    assert residual.shape == x.shape and residual.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, residual)
    return out, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference (Hugging Face's LlamaRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype).float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`fused_add_rms_norm` (also updates ``residual`` in place)."""
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    return rms_norm_ref(residual, weight, eps), residual
