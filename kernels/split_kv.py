"""Flash-decoding's split of each sequence's KV range, as every split decode kernel does it
(the paged decode, ``decode_attention``; MLA's, ``mla_attention``): how many splits, the range
each split walks, where its normalised partial output and log-sum-exp go, and the kernel that
merges the splits (``out = sum_i exp(lse_i - lse) * o_i``). Each kernel keeps its own math
between :func:`split_range` and :func:`store_split_output`."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from llmkit.kernels._jit import device_function, jit, next_power_of_2


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, *,
                       target_programs: int, min_split_len: int = 128,
                       max_splits: int = 16) -> int:
    """Flash-decoding's split count: enough programs to fill the device (``target_programs``,
    e.g. 2x its SM count), each split at least ``min_split_len`` tokens long. (``num_kv_heads``:
    the programs per sequence besides the splits.)"""
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, target_programs // programs)
    by_len = max(1, max_seq_len // max(1, min_split_len))
    return int(max(1, min(want, by_len, max_splits)))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_splits(device: torch.device, num_seqs: int, programs_per_seq: int,
                      max_seq_len: int, *, target_programs: int | None = None,
                      min_split_len: int = 128, max_splits: int = 16) -> int:
    """:func:`default_num_splits` for a launch on ``device``: ``target_programs`` defaults to
    twice a CUDA device's SM count, and to 1 (no split) elsewhere (Triton's interpreter)."""
    if target_programs is None:
        target_programs = 2 * _num_sms(device.index or 0) if device.type == "cuda" else 1
    return default_num_splits(num_seqs, programs_per_seq, max_seq_len,
                              target_programs=target_programs, min_split_len=min_split_len,
                              max_splits=max_splits)


@device_function
def split_range(seq_len, first, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions ``[start, end)`` that split ``split`` of ``first .. seq_len`` walks. Splits
    cover whole ``BLOCK_N`` tiles so that no tile straddles two of them."""
    per_split = (seq_len - first + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end


@device_function
def store_split_output(acc, l_i, m_i, seq, split, heads, h_ok, offs_d, d_ok,
                       out_ptr, part_out_ptr, part_lse_ptr,
                       stride_os, stride_oh, stride_ps, stride_ph, stride_pk,
                       NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """The online softmax's result for query ``heads [BLOCK_H]`` of ``seq``: ``acc / l`` (the
    accumulated ``p . v`` rows over the sums of ``p``; ``m`` the running max, log2 domain).
    One split: straight into ``out``. Several: the partial output and its natural-log LSE
    (-inf marks an empty split, which the merge weighs 0)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = h_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        p_base = seq * stride_ps + heads * stride_ph + split * stride_pk
        tl.store(part_out_ptr + p_base[:, None] + offs_d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + (seq * NUM_HEADS + heads) * NUM_SPLITS + split, lse, mask=h_ok)


@jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ps, stride_ph, stride_pk,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_HEADS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    k_ok = offs_k < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    base = seq * stride_ps + head * stride_ph + offs_k * stride_pk
    lse = tl.load(part_lse_ptr + (seq * NUM_HEADS + head) * NUM_SPLITS + offs_k, mask=k_ok,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse - lse_max)  # empty splits weigh 0
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    o = tl.load(part_out_ptr + base[:, None] + offs_d[None, :],
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True, slots=True)
class KVSplits:
    """One launch's splits and their partial buffers: ``part_out [seq, head, split, block_d]``
    float32 and ``part_lse [seq, head, split]`` (both ``out`` itself, unused, for one split);
    ``strides``: ``part_out``'s (seq, head, split) strides (``part_lse`` is contiguous)."""

    num_splits: int
    part_out: torch.Tensor
    part_lse: torch.Tensor
    block_d: int
    strides: tuple[int, int, int]

    @classmethod
    def allocate(cls, out: torch.Tensor, num_splits: int, block_d: int) -> "KVSplits":
        """Buffers for ``out [num_seqs, num_heads, width]`` computed in ``num_splits`` splits
        (at least 1), each head's partial row ``block_d`` wide."""
        num_splits = max(1, int(num_splits))
        b, h = out.shape[:2]
        strides = (h * num_splits * block_d, num_splits * block_d, block_d)
        if num_splits == 1:
            return cls(1, out, out, block_d, strides)
        return cls(num_splits,
                   torch.empty(b, h, num_splits, block_d, dtype=torch.float32, device=out.device),
                   torch.empty(b, h, num_splits, dtype=torch.float32, device=out.device),
                   block_d, strides)

    def grid(self, num_seqs: int, programs_per_seq: int) -> tuple[int, int, int]:
        """The split kernel's grid: ``(seq, its programs (KV heads or head blocks), split)``."""
        return (num_seqs, programs_per_seq, self.num_splits)

    def merge(self, out: torch.Tensor, width: int) -> None:
        """Merge the splits into ``out [num_seqs, num_heads, width]`` (nothing for one)."""
        if self.num_splits == 1:
            return
        b, h = out.shape[:2]
        _decode_reduce_kernel[(b, h)](
            self.part_out, self.part_lse, out, *self.strides, out.stride(0), out.stride(1),
            HEAD_DIM=width, BLOCK_D=self.block_d, NUM_SPLITS=self.num_splits,
            BLOCK_K=next_power_of_2(self.num_splits), NUM_HEADS=h,
        )
