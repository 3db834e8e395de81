"""``fused_moe``: a mixture-of-experts layer's routed experts as two grouped GEMM launches
(vLLM's ``fused_moe`` design, written anew).

The ``T * k`` (token, choice) slots are sorted by expert and each expert's run padded to a
multiple of ``BLOCK_M`` (:func:`moe_align_block_size`, torch ops on the device, no host sync:
CUDA-graph safe). One program computes a ``BLOCK_M x BLOCK_N`` tile of one block's slots, all
of one expert, so it streams that expert's weight tile once for up to ``BLOCK_M`` tokens:

1. ``gate_up [T*k, 2I] = x[slot // k] @ w13[e]^T``;
2. ``h = silu(gate) * up`` (``silu_and_mul``);
3. ``y [T*k, H] = topk_weight[slot] * (h[slot] @ w2[e]^T)`` in float32;

then the ``k`` rows of a token are summed in ``k`` order. Slots routed to experts another rank
holds (expert parallel: ``expert_map`` -1) go to no block and add zero. The torch reference is
``llmkit.ops.moe.fused_moe_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmkit.kernels._jit import dot_precision, jit
from llmkit.kernels.activation import silu_and_mul

#: Tile sizes (a start: not tuned on a GPU yet).
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_slots_ptr, block_experts_ptr,
    N, K, num_slots, num_experts, a_rows_per_slot_div,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:  # a block past the last expert's run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    slot_ok = slots < num_slots  # padding of the expert's run
    a_rows = (slots // a_rows_per_slot_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + slots, mask=slot_ok, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])


def moe_align_block_size(ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [S]`` local expert ids (``num_experts`` = not on this rank) -> ``(sorted_slots
    [num_blocks * block_m], block_experts [num_blocks])``: the slots grouped by expert, each
    expert's run padded to whole blocks (padding holds ``S``), and each block's expert
    (``num_experts`` for the unused blocks at the end). Sizes depend only on ``S`` and ``E``."""
    s = ids.shape[0]
    device = ids.device
    num_blocks = triton.cdiv(s + num_experts * (block_m - 1), block_m)
    # (not torch.bincount: on CUDA it reads the largest id back to the host)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, ids, torch.ones_like(ids))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    here = sorted_ids < num_experts
    e = sorted_ids.clamp(max=num_experts - 1)
    rank_in_run = torch.arange(s, device=device) - count_start[e]
    trash = num_blocks * block_m  # one slot past the end takes the slots of other ranks
    dest = torch.where(here, padded_start[e] + rank_in_run, trash)
    sorted_slots = torch.full((trash + 1,), s, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_slots[:trash], block_experts


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                  topk_weights: torch.Tensor, sorted_slots: torch.Tensor,
                  block_experts: torch.Tensor, num_slots: int, a_rows_per_slot: int,
                  mul_routed_weight: bool) -> None:
    num_experts, n, k = b.shape
    assert a.stride(-1) == 1 and out.stride(-1) == 1
    grid = (block_experts.shape[0], triton.cdiv(n, BLOCK_N))
    _fused_moe_kernel[grid](
        a, b, out, topk_weights, sorted_slots, block_experts,
        n, k, num_slots, num_experts, a_rows_per_slot,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision(a.dtype))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, H]`` through this rank's experts -> ``[T, H]`` (shapes as in
    ``llmkit.ops.moe``)."""
    t, k = topk_ids.shape
    num_local, two_i, hidden = w13.shape
    if t == 0:
        return x.new_zeros(x.shape)
    x = x.contiguous()
    num_slots = t * k
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # experts of other ranks: the bucket past the last one
        local = expert_map[ids].long()
        ids = torch.where(local >= 0, local, num_local)
    sorted_slots, block_experts = moe_align_block_size(ids, num_local, BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()
    # zeros where some slots go to other ranks' experts (their rows are never computed)
    alloc = torch.empty if expert_map is None else torch.zeros
    gate_up = alloc(num_slots, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_slots, block_experts, num_slots, k, False)
    h = silu_and_mul(gate_up)
    y = torch.zeros(num_slots, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(h, w2, y, weights, sorted_slots, block_experts, num_slots, 1, True)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)
