"""Logprobs of chosen tokens and the top-k, from the model's raw distribution.

As vLLM does by default, logprobs describe the model's own distribution: a float32
``log_softmax`` of the logits before any logits processor, penalty or temperature. The tensors
stay on the device until the runner turns them into plain lists once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.outputs import LogprobsLists


@dataclass(slots=True)
class LogprobsTensors:
    """``token_ids[:, 0]`` is the chosen token, ``token_ids[:, 1:]`` the top-k (descending);
    ``logprobs`` alike; ``ranks`` the chosen token's rank (1 = most likely)."""

    token_ids: torch.Tensor  # int64 [N, k + 1]
    logprobs: torch.Tensor  # float32 [N, k + 1]
    ranks: torch.Tensor  # int64 [N]

    def to_lists(self) -> LogprobsLists:
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(),
                             self.ranks.tolist())


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of ``chosen`` (``[N]``) and the top-``k`` of each row of raw ``logits``."""
    logprobs = logits.float().log_softmax(dim=-1)
    return gather_logprobs(logprobs, chosen, k)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    chosen = chosen.to(torch.int64).unsqueeze(-1)
    chosen_lp = logprobs.gather(-1, chosen)
    # vLLM's rank: how many tokens are at least as likely as the chosen one.
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids = torch.cat([chosen, top_ids], dim=-1)
        lps = torch.cat([chosen_lp, top_lp], dim=-1)
    else:
        ids, lps = chosen, chosen_lp
    return LogprobsTensors(ids, lps, ranks)
