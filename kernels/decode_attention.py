"""Paged decode attention: one query token per sequence against its KV blocks, read in place
through the block table (no gather copy), with grouped-query attention and an optional split
of the KV length (flash-decoding) plus the kernel that merges the splits.

Program ``(seq, kv_head, split)`` loads the query rows of every query head that shares
``kv_head`` as one ``[BLOCK_H, HEAD_DIM]`` tile, so each K/V byte is read once per group, not
once per query head: decode is bound by HBM bandwidth, and this is where the bytes are.
With ``num_splits > 1`` each split writes its normalised partial output and its log-sum-exp,
merged by a second kernel (``split_kv``, shared with MLA's decode).
A quantized cache (``kv_quant``) is dequantized as it is loaded: codes times each row's scale.
A sliding window ``W`` starts each sequence's KV range (and its splits) at ``seq_len - W``, so
no block before the window is read; a soft cap ``c`` maps scores to ``c * tanh(s / c)``.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from llmkit.kernels._jit import dot_precision, jit, next_power_of_2
from llmkit.kernels.kv_quant import head_dim_of, quant_args, read_rows
from llmkit.kernels.paged_kv import load_kv_tile, soft_capped_log2
from llmkit.kernels.split_kv import KVSplits, split_range, store_split_output

LOG2E = 1.4426950408889634


@jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, scale_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr,
    sm_scale_log2, sliding_window, soft_cap,
    stride_qs, stride_qh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr, WINDOWED: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - sliding_window, 0)
    start, end = split_range(seq_len, first, split, NUM_SPLITS, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < QUERIES_PER_KV
    d_ok = offs_d < HEAD_DIM
    q_head = kv_head * QUERIES_PER_KV + offs_h
    q = tl.load(q_ptr + seq * stride_qs + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e38, dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_c_head

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        tok = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_tok
        k, v = load_kv_tile(cache_ptr, scale_ptr, head_off, tok, n_ok, offs_d, d_ok,
                            stride_c_kv, HEAD_DIM, QUANT)
        v = v.to(q_ptr.dtype.element_ty)
        # Dots in the storage dtype (tensor cores for bf16/fp16), accumulated in float32.
        # scores [BLOCK_H, BLOCK_N], in the log2 domain
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if SOFT_CAP:
            s = soft_capped_log2(s, sm_scale_log2, soft_cap)
        else:
            s = s * sm_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    store_split_output(acc, l_i, m_i, seq, split, q_head, h_ok, offs_d, d_ok,
                       out_ptr, part_out_ptr, part_lse_ptr,
                       stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
                       NUM_SPLITS, NUM_HEADS)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, num_splits: int = 1,
                           out: torch.Tensor | None = None, block_n: int | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None
                           ) -> torch.Tensor:
    """Attention of ``q [num_seqs, num_heads, head_dim]`` (one token per sequence, the last of
    its ``seq_lens[i]`` tokens) over ``kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim]`` through ``block_table [num_seqs, max_blocks]``. ``num_splits > 1`` splits each
    sequence's KV range (flash-decoding) and merges the splits with a second kernel.
    ``sliding_window``: the last W positions only (no block before them is read);
    ``soft_cap``: scores ``c * tanh(s / c)``."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert head_dim_of(kv_cache) == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    quant, scales = quant_args(kv_cache)
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    block_h = max(16, next_power_of_2(group))  # tl.dot needs >= 16 rows
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    splits = KVSplits.allocate(out, num_splits, block_d)
    _paged_decode_kernel[splits.grid(num_seqs, num_kv_heads)](
        q, kv_cache, scales, block_table, seq_lens, out, splits.part_out, splits.part_lse,
        scale * LOG2E, sliding_window or 0, soft_cap or 0.0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        *splits.strides,
        QUERIES_PER_KV=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=splits.num_splits,
        NUM_HEADS=num_heads, DOT_PRECISION=dot_precision(q.dtype), QUANT=quant,
        WINDOWED=sliding_window is not None, SOFT_CAP=soft_cap is not None,
    )
    splits.merge(out, head_dim)
    return out


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, *, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention` (float32 math, one sequence at a
    time, K/V gathered through the block table)."""
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    for i, n in enumerate(seq_lens.tolist()):
        first = 0 if sliding_window is None else max(0, n - sliding_window)
        b0 = first // block_size  # no block before the window is read
        ids = block_table[i, b0:math.ceil(n / block_size)].long()
        lo = first - b0 * block_size
        k = read_rows(kv_cache[0, ids].flatten(0, 1)[lo:n - b0 * block_size], torch.float32)
        v = read_rows(kv_cache[1, ids].flatten(0, 1)[lo:n - b0 * block_size], torch.float32)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
