"""``reshape_and_cache``: write this step's K and V into the paged KV cache at ``slot_mapping``.

Cache layout (llmkit's ``AttentionBackend.kv_cache_shape``):
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``; ``slot = block * block_size +
offset``; a slot of -1 (padding, or a token whose K/V must not be stored) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2


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


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [num_tokens, num_kv_heads, head_dim]`` (any token/head strides, last dim
    contiguous) into ``kv_cache`` at ``slot_mapping [num_tokens]``; slots < 0 are skipped."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
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


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`reshape_and_cache`."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    n = slot_mapping.shape[0]
    flat[0].index_copy_(0, slots, k[:n][keep].to(flat.dtype))
    flat[1].index_copy_(0, slots, v[:n][keep].to(flat.dtype))
