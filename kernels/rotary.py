"""Rotary position embedding applied in place to ``q`` and ``k`` from a cos/sin cache.

``cos_sin_cache [max_position, rot_dim]`` holds ``cos`` of each frequency in its first half and
``sin`` in its second (``llmkit.models.layers.RotaryEmbedding.cos_sin_cache``, vLLM's layout).
The first ``rot_dim`` dims of every head rotate (``rot_dim == head_dim`` for Llama); pairs are
``(i, i + rot_dim/2)`` in the neox layout ("rotate half") and ``(2i, 2i + 1)`` in GPT-J's.
One program rotates every head of q and k of one token: the token's cos/sin row is read once.
"""
from __future__ import annotations

import torch
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2


@jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_ok = offs_i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_i, mask=i_ok,
                  other=0.0).to(tl.float32)
    if IS_NEOX:
        first = offs_i
        second = offs_i + HALF
    else:
        first = 2 * offs_i
        second = 2 * offs_i + 1
    t64 = t.to(tl.int64)

    offs_hq = tl.arange(0, BLOCK_HQ)
    mq = (offs_hq < NUM_Q_HEADS)[:, None] & i_ok[None, :]
    base = q_ptr + t64 * stride_qt + offs_hq[:, None] * stride_qh
    x1 = tl.load(base + first[None, :], mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=mq, other=0.0).to(tl.float32)
    tl.store(base + first[None, :], (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(base + second[None, :], (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mq)

    offs_hk = tl.arange(0, BLOCK_HK)
    mk = (offs_hk < NUM_K_HEADS)[:, None] & i_ok[None, :]
    base = k_ptr + t64 * stride_kt + offs_hk[:, None] * stride_kh
    x1 = tl.load(base + first[None, :], mask=mk, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=mk, other=0.0).to(tl.float32)
    tl.store(base + first[None, :], (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mk)
    tl.store(base + second[None, :], (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mk)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Rotate ``q [num_tokens, num_heads, head_dim]`` and ``k [num_tokens, num_kv_heads,
    head_dim]`` in place (any token/head strides, last dim contiguous, e.g. views of a fused
    qkv output) at ``positions [num_tokens]``."""
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= q.shape[-1]
    half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half, IS_NEOX=bool(is_neox),
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
    )


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Torch reference of :func:`rotary_embedding` (float32 math, in place)."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, half]
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        r = x[..., :rot_dim].float()
        if is_neox:
            x1, x2 = r.chunk(2, dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if is_neox:
            rotated = torch.cat([o1, o2], dim=-1)
        else:
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
        x[..., :rot_dim] = rotated.to(x.dtype)
