"""``reshape_and_cache``: write this step's K and V into the paged KV cache at ``slot_mapping``.

Cache layout (llmkit's ``AttentionBackend.kv_cache_shape``):
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``; ``slot = block * block_size +
offset``; a slot of -1 (padding, or a token whose K/V must not be stored) is skipped. A
quantized cache (``kv_cache.cache_dtype=int8|fp8_e4m3``) holds rows of ``head_dim`` codes and a
float32 scale (``kv_quant``); the write quantizes each (token, KV head) row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2
from llmkit.kernels.kv_quant import (FP8_E4M3, SCALE_BYTES, KVQuantFormat, format_of,
                                     to_cache_rows)


@jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    # One program stores BLOCK_T tokens, all their heads: a [BLOCK_T, heads * head_dim] tile.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_ok, other=-1).to(tl.int64)
    keep = t_ok & (slot >= 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_hd = tl.arange(0, BLOCK_HD)
    head = offs_hd // HEAD_DIM
    dim = offs_hd % HEAD_DIM
    hd_ok = offs_hd < NUM_KV_HEADS * HEAD_DIM
    mask = keep[:, None] & hd_ok[None, :]
    t64 = offs_t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :],
                mask=mask)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :],
                mask=mask)
    dst = cache_ptr + blk[:, None] * stride_c_blk + off[:, None] * stride_c_tok \
        + head[None, :] * stride_c_head + dim[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@jit
def _reshape_and_cache_quant_kernel(
    k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
):
    # Program (token tile, KV head): BLOCK_T rows of one head, each quantized with its own
    # scale (``kv_quant``: codes, then the float32 scale in the row's last 4 bytes). The
    # cache's strides count bytes; ``scale_ptr`` is the same memory seen as float32.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_ok, other=-1).to(tl.int64)
    keep = t_ok & (slot >= 0)
    row = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok \
        + head * stride_c_head
    offs_d = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (offs_d < HEAD_DIM)[None, :]
    t64 = offs_t.to(tl.int64)
    for kv in tl.static_range(2):
        if kv == 0:
            x = tl.load(k_ptr + t64[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(v_ptr + t64[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        # IEEE divisions (div_rn): a GPU's plain '/' is approximate, and the codes must be
        # the torch reference's bits
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        div = tl.where(scale > 0, scale, 1.0)
        y = tl.math.div_rn(x, div[:, None] + tl.zeros_like(x))
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_FP8:
            # e4m3fn, round half to even, from the float32 bits (Triton's interpreter drops
            # the carry into the exponent when the mantissa rounds up): normal values round
            # the exponent+mantissa field at its 3rd mantissa bit (a carry moves the
            # exponent), re-biased 127 -> 7; below 2**-6 the codes are multiples of 2**-9.
            bits = y.to(tl.uint32, bitcast=True)
            mag = bits & 0x7FFFFFFF
            normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
            a = tl.abs(y)
            small = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.uint32)
            codes = (tl.where(a < 0.015625, small, normal) | ((bits >> 31) << 7)).to(tl.uint8)
        else:
            # round half to even (torch.round): adding 1.5 * 2**23 leaves the integer part
            codes = ((y + 12582912.0) - 12582912.0).to(tl.int8)
        base = kv * stride_c_kv + row
        tl.store(cache_ptr + base[:, None] + offs_d[None, :], codes, mask=mask)
        tl.store(scale_ptr + (base + HEAD_DIM) // 4, scale, mask=keep)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [num_tokens, num_kv_heads, head_dim]`` (any token/head strides, last dim
    contiguous) into ``kv_cache`` at ``slot_mapping [num_tokens]``; slots < 0 are skipped. A
    quantized cache (``kv_quant``: int8/uint8 rows of ``head_dim + 4``) gets codes and scales."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    fmt = format_of(kv_cache)
    if fmt is not None:
        _reshape_and_cache_quant(k, v, kv_cache, slot_mapping, fmt)
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert k.shape[1:] == (num_kv_heads, head_dim) and v.shape[1:] == (num_kv_heads, head_dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    block_hd = next_power_of_2(num_kv_heads * head_dim)
    # ~4K elements per program: enough work per program on a GPU, few programs interpreted.
    block_t = max(1, min(next_power_of_2(num_tokens), 4096 // block_hd))
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        k, v, kv_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_HD=block_hd,
    )


def _reshape_and_cache_quant(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, fmt: KVQuantFormat) -> None:
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, width = kv_cache.shape
    head_dim = width - SCALE_BYTES
    assert k.shape[1:] == (num_kv_heads, head_dim) and v.shape[1:] == (num_kv_heads, head_dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
    assert head_dim % 4 == 0, "a quantized KV cache needs head_dim % 4 == 0 (aligned scales)"
    block_d = next_power_of_2(head_dim)
    block_t = max(1, min(next_power_of_2(num_tokens), 4096 // block_d))
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _reshape_and_cache_quant_kernel[grid](
        k, v, kv_cache, kv_cache.view(torch.float32), slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=block_d,
        QMAX=fmt.qmax, IS_FP8=fmt is FP8_E4M3,
    )


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`reshape_and_cache` (quantizing as ``kv_quant`` does)."""
    num_kv_heads, width = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(2, -1, num_kv_heads, width)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    n = slot_mapping.shape[0]
    flat[0].index_copy_(0, slots, to_cache_rows(k[:n][keep], flat.dtype))
    flat[1].index_copy_(0, slots, to_cache_rows(v[:n][keep], flat.dtype))
