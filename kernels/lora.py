"""Batched LoRA (punica's SGMV): each row of a step adds its own adapter's ``x A^T B^T``.

The rows that use an adapter are sorted by slot (``RowSlots.sorted_segments``); a *segment* is
the run of rows of one slot. Two kernels, one launch each per layer, every segment at once:

- ``shrink``: ``t[row] = x[row] @ A[slot]^T`` for all shards of the layer together
  (``A [slots, S*R, in]``: shard s's rank-R rows at ``s*R``), float32 ``t [rows, S*R]``;
- ``expand``: ``y[row, o] += t[row, s*R:(s+1)*R] @ B^T[slot, :, o]`` for the output columns
  ``o`` of shard ``s`` (``B^T [slots, R, out]``): fused q/k/v and gate/up take one stacked
  adapter each.

A program covers up to ``BLOCK_M`` rows of one segment (gathered through the sorted order) and
one tile of outputs, so each weight tile is read once per block of rows, not once per row as in
per-row (BGMV) kernels. Rows of the base model are not touched. ``add_lora_ref`` is the torch
reference (the same segments, one GEMM pair each).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.kernels._jit import jit, next_power_of_2


@jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, t_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    K, N, stride_x, stride_as, stride_an, stride_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    if m0 >= seg_len:
        return
    start = tl.load(seg_start_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(order_ptr + start + m, mask=m_mask, other=0).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xs = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + n[None, :] * stride_an + k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(xs.to(tl.float32), a.to(tl.float32))
    tl.store(t_ptr + rows[:, None] * stride_t + n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, out_offsets_ptr,
    R, tiles_per_shard, stride_t, stride_bs, stride_br, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    if m0 >= seg_len:
        return
    shard = tl.program_id(2) // tiles_per_shard
    tile = tl.program_id(2) % tiles_per_shard
    o_lo = tl.load(out_offsets_ptr + shard)
    o_hi = tl.load(out_offsets_ptr + shard + 1)
    o = o_lo + tile * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < o_hi
    if o_lo + tile * BLOCK_O >= o_hi:
        return
    start = tl.load(seg_start_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(order_ptr + start + m, mask=m_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    ts = tl.load(t_ptr + rows[:, None] * stride_t + shard * R + r[None, :],
                 mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + o[None, :],
                mask=o_mask[None, :] & r_mask[:, None], other=0.0)
    delta = tl.dot(ts, b.to(tl.float32))
    y_ptrs = y_ptr + rows[:, None] * stride_y + o[None, :]
    mask = m_mask[:, None] & o_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             out_offsets: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
             seg_len: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int) -> None:
    """``y [rows, out] += x A[slot]^T B[slot]^T`` per segment, in place.

    ``x [rows, in]``, ``lora_a [slots, S*R, in]``, ``lora_b`` (B^T) ``[slots, R, out]``,
    ``out_offsets`` int32 ``[S + 1]`` (shard s's outputs are ``[off[s], off[s+1])``);
    ``order``, ``seg_*`` int32 from ``RowSlots.sorted_segments``. Zero-padded ranks (an
    adapter of rank < R) add zeros."""
    num_segs = seg_len.shape[0]
    if num_segs == 0 or max_seg_len == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1
    assert lora_a.is_contiguous() and lora_b.is_contiguous()
    rows, k = x.shape
    n = lora_a.shape[1]
    r = lora_b.shape[1]
    num_shards = out_offsets.shape[0] - 1
    t = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    block_m = 16 if max_seg_len <= 16 else 32
    block_n = max(16, min(next_power_of_2(n), 64))
    block_k = max(16, min(next_power_of_2(k), 64))
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _lora_shrink_kernel[grid](x, lora_a, t, order, seg_start, seg_len, seg_slot, k, n,
                              x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    sizes = (out_offsets[1:] - out_offsets[:-1]).tolist()
    block_o = max(16, min(next_power_of_2(max(sizes)), 64))
    tiles = triton.cdiv(max(sizes), block_o)
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), num_shards * tiles)
    _lora_expand_kernel[grid](t, lora_b, y, order, seg_start, seg_len, seg_slot, out_offsets,
                              r, tiles, t.stride(0), lora_b.stride(0), lora_b.stride(1),
                              y.stride(0), BLOCK_M=block_m, BLOCK_O=block_o,
                              BLOCK_R=max(16, next_power_of_2(r)))


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 out_offsets: torch.Tensor, row_slots: torch.Tensor) -> None:
    """Torch reference of :func:`add_lora` (float32 math): ``row_slots [rows]`` int, -1 = base."""
    r = lora_b.shape[1]
    offs = out_offsets.tolist()
    for slot in torch.unique(row_slots).tolist():
        if slot < 0:
            continue
        idx = torch.nonzero(row_slots == slot).flatten()
        t = x[idx].float() @ lora_a[slot].float().T
        for s in range(len(offs) - 1):
            o0, o1 = offs[s], offs[s + 1]
            d = t[:, s * r:(s + 1) * r] @ lora_b[slot, :, o0:o1].float()
            y[idx, o0:o1] = (y[idx, o0:o1].float() + d).to(y.dtype)
