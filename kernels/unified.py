"""Unified varlen attention over the paged KV cache: one launch serves a batch that mixes
prefills, chunked prefills and decodes.

Request ``i`` brings ``q_len = query_start_loc[i+1] - query_start_loc[i]`` new tokens (already
written to the cache) and has ``seq_lens[i]`` tokens of context in all, so its new tokens sit at
positions ``seq_lens[i] - q_len ...``; each attends to every cached token before it and causally
to the new ones. The new tokens are cut into tiles of ``BLOCK_Q`` query tokens (a host-side tile
map: tile -> (request, first query offset)); program ``(tile, kv_head)`` holds the ``BLOCK_Q x
group`` query rows that share one KV head as a ``[BLOCK_M, HEAD_DIM]`` tile and streams that
request's K/V through its block table with an online softmax (FlashAttention-2), stopping at the
tile's causal bound. A quantized cache (``kv_quant``) is dequantized as it is loaded. With a
sliding window ``W`` a tile starts at its first query's window (``pos > q_pos - W``), so no
block before it is read; a soft cap ``c`` maps scores to ``c * tanh(s / c)``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import triton.language as tl

from llmkit.kernels._jit import dot_precision, jit, next_power_of_2
from llmkit.kernels.kv_quant import head_dim_of, quant_args, read_rows
from llmkit.kernels.paged_kv import load_kv_tile, soft_capped_log2

LOG2E = 1.4426950408889634


@jit
def _unified_attention_kernel(
    q_ptr, cache_ptr, scale_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    tile_seq_ptr, tile_qoff_ptr,
    sm_scale_log2, sliding_window, soft_cap,
    stride_qt, stride_qh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    stride_bt,
    stride_ot, stride_oh,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr, WINDOWED: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_qoff_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = q_off + offs_m // BLOCK_H  # query token within the request's new tokens
    h = offs_m % BLOCK_H
    row_ok = (q_idx < q_len) & (h < QUERIES_PER_KV)
    d_ok = offs_d < HEAD_DIM
    q_head = kv_head * QUERIES_PER_KV + h
    q_tok = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh
                + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = ctx_len + q_idx  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_c_head
    # The tile's last query token sees positions up to its own: nothing beyond is read.
    kv_end = tl.minimum(seq_len, ctx_len + q_off + BLOCK_Q)
    # ... and its first query token's window nothing before.
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(ctx_len + q_off - sliding_window + 1, 0)

    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < kv_end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        tok = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_tok
        k, v = load_kv_tile(cache_ptr, scale_ptr, head_off, tok, n_ok, offs_d, d_ok,
                            stride_c_kv, HEAD_DIM, QUANT)
        v = v.to(q_ptr.dtype.element_ty)
        # [BLOCK_M, BLOCK_N] scores in the log2 domain
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if SOFT_CAP:
            s = soft_capped_log2(s, sm_scale_log2, soft_cap)
        else:
            s = s * sm_scale_log2
        causal = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            causal = causal & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_tok[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


def choose_block_q(max_query_len: int, queries_per_kv: int) -> int:
    """Query tokens per tile: ``BLOCK_Q * group`` rows make a 16-row tile for batches of short
    queries (decodes waste little) and a 64-row tile once prefills are in the batch."""
    block_h = next_power_of_2(queries_per_kv)
    block_m = 64 if max_query_len * block_h >= 64 else 16
    return max(1, block_m // block_h)


def unified_attention_tiles(query_start_loc: Sequence[int], block_q: int,
                            device: torch.device | str = "cpu"
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile map: ``(tile_seq, tile_qoff)`` int32, one entry per ``block_q`` new tokens of
    each request (computed on the host from ``query_start_loc``)."""
    seqs: list[int] = []
    offs: list[int] = []
    for i in range(len(query_start_loc) - 1):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        n = -(-q_len // block_q)
        seqs.extend([i] * n)
        offs.extend(range(0, n * block_q, block_q))
    return (torch.tensor(seqs, dtype=torch.int32).to(device),
            torch.tensor(offs, dtype=torch.int32).to(device))


def unified_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, *,
                      out: torch.Tensor | None = None, max_query_len: int | None = None,
                      tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                      block_n: int | None = None, sliding_window: int | None = None,
                      soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [num_tokens, num_heads, head_dim]`` (requests' new tokens packed
    by ``query_start_loc [num_reqs + 1]``) over ``kv_cache [2, num_blocks, block_size,
    num_kv_heads, head_dim]``, which already holds them. ``tiles=(tile_seq, tile_qoff,
    block_q)`` reuses a tile map built once per step (see :func:`unified_attention_tiles`);
    without it the map is built here from a host copy of ``query_start_loc``.
    ``sliding_window``: the query at position p sees keys ``p - W + 1 .. p`` only;
    ``soft_cap``: scores ``c * tanh(s / c)``."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert head_dim_of(kv_cache) == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    if tiles is None:
        qsl = query_start_loc.tolist()
        if max_query_len is None:
            max_query_len = max(b - a for a, b in zip(qsl, qsl[1:]))
        block_q = choose_block_q(max_query_len, group)
        tile_seq, tile_qoff = unified_attention_tiles(qsl, block_q, q.device)
    else:
        tile_seq, tile_qoff, block_q = tiles
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return out
    block_h = next_power_of_2(group)
    block_m = max(16, block_q * block_h)
    block_d = next_power_of_2(head_dim)
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    quant, scales = quant_args(kv_cache)
    _unified_attention_kernel[(num_tiles, num_kv_heads)](
        q, kv_cache, scales, out, block_table, seq_lens, query_start_loc, tile_seq, tile_qoff,
        scale * LOG2E, sliding_window or 0, soft_cap or 0.0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        QUERIES_PER_KV=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_m // block_q,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), QUANT=quant,
        WINDOWED=sliding_window is not None, SOFT_CAP=soft_cap is not None,
    )
    return out


def unified_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_table: torch.Tensor, scale: float, *,
                          sliding_window: int | None = None,
                          soft_cap: float | None = None) -> torch.Tensor:
    """Torch reference of :func:`unified_attention`: per request, float32 softmax attention of
    its new tokens over its context with a causal mask offset by the cached prefix (and the
    window's lower bound, with blocks before the first query's window never read)."""
    out = torch.zeros_like(q)
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    qsl = query_start_loc.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        a, b = qsl[i], qsl[i + 1]
        if b == a:
            continue
        first = 0 if sliding_window is None else max(0, n - (b - a) - sliding_window + 1)
        b0 = first // block_size
        ids = block_table[i, b0:math.ceil(n / block_size)].long()
        k = read_rows(kv_cache[0, ids].flatten(0, 1)[:n - b0 * block_size], torch.float32)
        v = read_rows(kv_cache[1, ids].flatten(0, 1)[:n - b0 * block_size], torch.float32)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        s = torch.einsum("qhd,nhd->hqn", q[a:b].float(), k) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        q_pos = torch.arange(n - (b - a), n, device=s.device)
        k_pos = torch.arange(b0 * block_size, n, device=s.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        s = s.masked_fill(hidden, float("-inf"))
        out[a:b] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v).to(q.dtype)
    return out
