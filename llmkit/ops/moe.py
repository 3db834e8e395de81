"""Mixture-of-experts ops: the router's top-k and the routed experts' gated MLPs.

Shapes: ``x [T, H]``; ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows, as
``nn.Linear`` weights); ``w2 [E, H, I]``; ``topk_weights [T, k]`` float32 and ``topk_ids
[T, k]`` (global expert ids). ``expert_map [E_global]`` maps a global expert id to this rank's
local one, -1 where another rank holds that expert (expert parallel); ``None``: every expert is
here. The result is this rank's part of ``sum_k w_k * down_e(silu(gate_e x) * up_e x)``: under
expert or tensor parallel the ranks' parts are summed by one all-reduce after the op.

Three implementations, the same math:

- :func:`fused_moe_reference`: the definition, token by token (tests only: it gathers a copy of
  the expert weights per token);
- :func:`fused_moe_grouped`: tokens grouped by expert, one GEMM pair per active expert (no loop
  per token). The torch path of every platform, and the CPU's; registered as the opaque custom
  op ``llmkit::fused_moe_grouped`` so that a compiled step graph keeps its data-dependent group
  sizes out of the graph;
- the Triton kernel (``llmkit.kernels.fused_moe``, in ``kernels/moe.py``), for GPUs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def fused_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the ``top_k`` largest, renormalised to sum to one
    when the model says so (Mixtral always; Qwen-MoE when ``norm_topk_prob``). Returns
    ``(weights float32 [T, k], ids int32 [T, k])``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                     num_local: int) -> torch.Tensor:
    """``[T * k]`` int64 local expert ids, ``num_local`` (a bucket past the last expert) for
    the experts another rank holds."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        return ids
    local = expert_map[ids].long()
    return torch.where(local >= 0, local, num_local)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The definition in float32, each token through each of its experts (gathers the weights
    per token: a test reference, not a fast path)."""
    t, k = topk_ids.shape
    num_local = w13.shape[0]
    ids = local_expert_ids(topk_ids, expert_map, num_local).view(t, k)
    here = ids < num_local
    weights = topk_weights.float() * here
    ids = ids.clamp(max=num_local - 1)
    xf = x.float()
    gate_up = torch.einsum("th,tkoh->tko", xf, w13.float()[ids])
    inter = gate_up.shape[-1] // 2
    h = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.einsum("tki,tkhi->tkh", h, w2.float()[ids])
    return (y * weights[..., None]).sum(dim=1).to(x.dtype)


def _expert_linear(x: torch.Tensor, w: torch.Tensor, widen: bool) -> torch.Tensor:
    if widen:  # the same products, float32 accumulation, the output rounded back
        return F.linear(x.float(), w.float()).to(x.dtype)
    return F.linear(x, w)


def _fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       expert_map: Optional[torch.Tensor], widen_bf16_above: int) -> torch.Tensor:
    t, k = topk_ids.shape
    num_local = w13.shape[0]
    ids = local_expert_ids(topk_ids, expert_map, num_local)
    # slots (token, k) sorted by expert: expert e's tokens are one contiguous run
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_local + 1)[:num_local].tolist()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        widen = 0 <= widen_bf16_above < n and x.dtype == torch.bfloat16
        gate_up = _expert_linear(x[slots // k], w13[e], widen)
        inter = gate_up.shape[-1] // 2
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out[slots] = _expert_linear(h, w2[e], widen).float() * weights[slots, None]
    # the k contributions of a token summed in k order, whichever experts computed them
    return out.view(t, k, x.shape[1]).sum(dim=1).to(x.dtype)


@torch.library.custom_op("llmkit::fused_moe_grouped", mutates_args=())
def _fused_moe_grouped_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          expert_map: Optional[torch.Tensor],
                          widen_bf16_above: int) -> torch.Tensor:
    return _fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, expert_map,
                              widen_bf16_above)


@_fused_moe_grouped_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, expert_map, widen_bf16_above):
    return x.new_empty(x.shape)


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None = None,
                      widen_bf16_above: int = -1) -> torch.Tensor:
    """The routed experts with tokens grouped by expert: one gate/up GEMM and one down GEMM per
    expert that has tokens this step (the group sizes cost one host sync).

    ``widen_bf16_above >= 0``: a bf16 expert with more tokens than that computes in float32
    (CPUs without native bf16 emulate bf16 GEMMs; widening the expert's weights per call costs
    one pass over them, which a large group amortises; a small group's bf16 GEMV reads half
    the bytes and stays)."""
    return torch.ops.llmkit.fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, expert_map,
                                              widen_bf16_above)
