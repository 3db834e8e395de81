"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache: the latent
rows' write and the absorbed decode attention (``llmkit/ops/mla.py`` has the math).

Program ``(seq, head_block, split)`` holds up to ``BLOCK_H`` query heads of one sequence and
walks its context in tiles of ``BLOCK_N`` latent rows read in place through the block table:
each row is loaded once and serves every head of the block (the scores as two ``tl.dot``s,
``q_latent . c_kv`` and ``q_pe . k_pe``; the output as ``p . c_kv``). That one read per row for
all heads is MLA's point: the cache row is ``kv_lora_rank + rope`` wide whatever the head count.
With ``num_splits > 1`` each split writes its normalised partial output and log-sum-exp and the
paged decode's merge (``split_kv``) combines them.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from llmkit.kernels._jit import dot_precision, jit, next_power_of_2
from llmkit.kernels.decode_attention import LOG2E
from llmkit.kernels.split_kv import KVSplits, split_range, store_split_output

# Query heads per program: tl.dot needs >= 16 rows; more heads per program would keep a
# [BLOCK_H, BLOCK_R] float32 accumulator too large for the registers at rank 512 (so programs
# per 16 heads: ceil(heads / BLOCK_H) per sequence, which a split count weighs).
BLOCK_H = 16


@jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_ptr, stride_lt, DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_D)
        ok = offs < DIM
        row = tl.load(latent_ptr + t * stride_lt + offs, mask=ok)
        tl.store(cache_ptr + slot * DIM + offs, row.to(cache_ptr.dtype.element_ty), mask=ok)


def write_latent_cache(latent: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """``latent [T, dim]`` rows into ``latent_cache [N, block_size, dim]`` at ``slot_mapping
    [n <= T]`` (-1 = skip), one program per token: no host sync for the skipped slots."""
    n, dim = slot_mapping.shape[0], latent_cache.shape[-1]
    assert latent.stride(-1) == 1 and latent_cache.is_contiguous() and latent.shape[-1] == dim
    if n == 0:
        return
    _write_latent_kernel[(n,)](latent, latent_cache, slot_mapping, latent.stride(0), DIM=dim,
                               BLOCK_D=next_power_of_2(dim))


def write_latent_cache_ref(latent: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`write_latent_cache`."""
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    keep = slot_mapping >= 0
    rows = latent[:slot_mapping.shape[0]][keep]
    flat.index_copy_(0, slot_mapping[keep].long(), rows.to(flat.dtype))


@jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr,
    sm_scale_log2,
    stride_ls, stride_lh, stride_rs, stride_rh,
    stride_c_blk, stride_c_tok,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = split_range(seq_len, 0, split, NUM_SPLITS, BLOCK_N)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < NUM_HEADS
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + seq * stride_ls + offs_h[:, None] * stride_lh + offs_r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * stride_rs + offs_h[:, None] * stride_rh + offs_p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e38, dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_R], 0.0, dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_tok
        # One latent row per token, loaded once for every head of the block.
        c_kv = tl.load(row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                       other=0.0)
        k_pe = tl.load(row[:, None] + RANK + offs_p[None, :],
                       mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        # scores [BLOCK_H, BLOCK_N] in the log2 domain; dots in the storage dtype, float32 sums
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = s * sm_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv,
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    store_split_output(acc, l_i, m_i, seq, split, offs_h, h_ok, offs_r, r_ok,
                       out_ptr, part_out_ptr, part_lse_ptr,
                       stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
                       NUM_SPLITS, NUM_HEADS)


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor,
                         latent_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, *, num_splits: int = 1,
                         out: torch.Tensor | None = None, block_n: int | None = None
                         ) -> torch.Tensor:
    """Absorbed MLA decode: ``q_latent [B, H, rank]`` and ``q_pe [B, H, rope]`` (one query
    token per sequence, the last of its ``seq_lens[i]``) over ``latent_cache [N, block_size,
    rank + rope]`` (of the queries' dtype) through ``block_table [B, max_blocks]``:
    ``[B, H, rank]``. ``num_splits > 1`` splits each context (flash-decoding) and merges."""
    b, h, rank = q_latent.shape
    rope = q_pe.shape[2]
    _, block_size, dim = latent_cache.shape
    assert dim == rank + rope and q_pe.shape[:2] == (b, h)
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.is_contiguous()
    assert latent_cache.dtype == q_latent.dtype == q_pe.dtype
    if out is None:
        out = torch.empty_like(q_latent)
    if b == 0:
        return out
    block_r = max(16, next_power_of_2(rank))
    block_p = max(16, next_power_of_2(rope))
    block_h = BLOCK_H
    if block_n is None:
        block_n = 32 if block_r <= 256 else 16  # the [BLOCK_N, BLOCK_R] tile in shared memory
    splits = KVSplits.allocate(out, num_splits, block_r)
    _mla_decode_kernel[splits.grid(b, math.ceil(h / block_h))](
        q_latent, q_pe, latent_cache, block_table, seq_lens, out, splits.part_out,
        splits.part_lse, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        *splits.strides,
        NUM_HEADS=h, RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_H=block_h,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=splits.num_splits,
        DOT_PRECISION=dot_precision(q_latent.dtype),
    )
    splits.merge(out, rank)
    return out


def mla_decode_attention_ref(q_latent: torch.Tensor, q_pe: torch.Tensor,
                             latent_cache: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference of :func:`mla_decode_attention` (float32 math, one sequence at a time,
    latent rows gathered through the block table)."""
    out = torch.empty_like(q_latent)
    block_size, rank = latent_cache.shape[1], q_latent.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        rows = latent_cache[block_table[i, :math.ceil(n / block_size)].long()].flatten(0, 1)
        rows = rows[:n].float()
        s = (q_latent[i].float() @ rows[:, :rank].T + q_pe[i].float() @ rows[:, rank:].T)
        out[i] = ((s * scale).softmax(-1) @ rows[:, :rank]).to(q_latent.dtype)
    return out
