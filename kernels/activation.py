"""``silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection's output
``x [..., 2d]``, in one pass (the torch version reads ``x`` twice and writes a temporary)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2


@jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, num_rows, d, stride_x, stride_o,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < d)[None, :]
    rows64 = rows.to(tl.int64)
    gate_ptr = x_ptr + rows64[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + d, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., 2d] -> [..., d]``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, d)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out
    block_c = min(next_power_of_2(d), 1024)
    block_r = max(1, min(next_power_of_2(num_rows), 4096 // block_c))
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(d, block_c))
    _silu_and_mul_kernel[grid](x2, o2, num_rows, d, x2.stride(0), o2.stride(0),
                               BLOCK_R=block_r, BLOCK_C=block_c)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference (float32 math, cast back)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)
