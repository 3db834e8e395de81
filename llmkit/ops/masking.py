"""Sliding-window masks and attention-logit soft-capping for the backends' torch paths.

A layer with ``sliding_window=W`` lets the query at position p see keys at positions
``p - W + 1 .. p`` (Hugging Face's ``sliding_window_overlay``: ``kv_idx > q_idx - W``); with
``logits_soft_cap=c`` the scaled scores become ``c * tanh(s / c)`` before the mask and the
softmax (Gemma 2). Both are per-layer constants, passed to ``AttentionBackend.forward``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def window_start(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first key position any of a row's ``query_len`` last tokens (of ``seq_len``) sees:
    blocks wholly before it are never read (a freed window's block table may hold anything
    there)."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """``[len(q_pos), len(k_pos)]`` bool: causal, and within the window when one is set."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              attn_mask: torch.Tensor | None, is_causal: bool, scale: float,
              enable_gqa: bool, soft_cap: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (``[..., H, T, D]`` layout), or, with ``soft_cap``,
    Hugging Face's eager op sequence (SDPA has no soft-capping): scores times ``scale``,
    ``tanh(s / c) * c``, the mask, a float32 softmax cast to q's dtype, times V."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / soft_cap) * soft_cap
    if is_causal:
        t, n = s.shape[-2], s.shape[-1]
        attn_mask = torch.ones(t, n, dtype=torch.bool, device=s.device).tril(n - t)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)
