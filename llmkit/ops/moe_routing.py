"""DeepSeek's MoE routers (torch reference): which experts a token goes to, and their weights.

Both return ``(weights float32 [T, k], ids int32 [T, k])``, the shapes ``fused_moe`` takes
(``llmkit/ops/moe.py``), with ``routed_scaling_factor`` already folded into the weights as
Hugging Face's DeepSeek routers do. Experts are cut into ``n_group`` equal consecutive groups;
a token first picks ``topk_group`` groups, then its ``top_k`` experts inside them only.

- :func:`softmax_group_topk`: DeepSeek-V2. Softmax scores; ``greedy`` takes the top-k of all
  experts, ``group_limited_greedy`` ranks groups by their best expert's score.
- :func:`sigmoid_noaux_topk`: DeepSeek-V3 (``noaux_tc``). Sigmoid scores; the choice (groups by
  the sum of their two best, then experts) reads the scores plus ``e_score_correction_bias``
  (the load-balancing bias learnt without an auxiliary loss), the weights the plain scores.
"""
from __future__ import annotations

import torch

#: ``topk_method`` values of a DeepSeek-V2 config.
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each token's ``topk_group`` best groups."""
    t, n_group = group_scores.shape
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand(t, n_group, num_experts // n_group).reshape(t, num_experts)


def softmax_group_topk(router_logits: torch.Tensor, top_k: int, *, method: str = "greedy",
                       n_group: int = 1, topk_group: int = 1, renormalize: bool = False,
                       scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router over ``router_logits [T, E]`` (float32)."""
    scores = router_logits.float().softmax(dim=-1)
    if method == "group_limited_greedy":
        e = scores.shape[-1]
        group_best = scores.view(-1, n_group, e // n_group).amax(dim=-1)
        # the other groups' experts score 0: softmax scores are positive, so never chosen
        scores = scores.masked_fill(~_group_mask(group_best, topk_group, e), 0.0)
    elif method != "greedy":
        raise ValueError(f"topk_method {method!r} is not a DeepSeek-V2 router; supported: "
                         f"{', '.join(V2_TOPK_METHODS)}")
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, ids.to(torch.int32)


def sigmoid_noaux_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                       *, n_group: int, topk_group: int, renormalize: bool,
                       scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router over ``router_logits [T, E]`` and ``correction_bias [E]``."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    e = scores.shape[-1]
    group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, topk_group, e), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids.to(torch.int32)
