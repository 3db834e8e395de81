"""The runner's pooling step (``model.runner=pooling``): each request's prompt is computed
(prefill only, in chunks when the scheduler cuts it) and the step that reaches its last token
hands back one pooled vector instead of a sampled token; nothing computes logits.

The vector is pooled from the final norm's output over the whole prompt however the prompt was
cut: mean pooling adds each chunk's rows to a float32 sum kept per request until the last
chunk, CLS keeps the first chunk's first row. A request recomputed from its first token (after
preemption) starts over. Last-token pooling needs the final chunk only, so it works behind a
prefix-cache hit (the scheduler always recomputes a prompt's last token); the others need every
token, and such engines run without prefix caching (``PoolingSpec.needs_every_token``).
"""
from __future__ import annotations

import numpy as np
import torch

from llmkit.models.pooling_config import PoolingSpec
from llmkit.outputs import ModelRunnerOutput

__all__ = ["PoolingRunner"]


class PoolingRunner:
    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec
        # per request whose prompt is still being computed: the float32 sum of its rows
        # (mean) or its first row (CLS)
        self._partial: dict[str, torch.Tensor] = {}

    def step_output(self, req_ids: list[str], query_starts: np.ndarray, computed: np.ndarray,
                    num_scheduled: np.ndarray, prompt_lens: np.ndarray, hidden: torch.Tensor,
                    dropped: set[str]) -> ModelRunnerOutput:
        """The step's output: a pooled vector for each request whose prompt this step
        completes (``prompt_lens``: each scheduled row's prompt length); ``dropped``: requests
        that finished or were preempted since the last step (their partial sums go)."""
        for rid in dropped:
            self._partial.pop(rid, None)
        kind = self.spec.pooling_type
        pooled: dict[str, list[float]] = {}
        for i, rid in enumerate(req_ids):
            start, n, done = int(query_starts[i]), int(num_scheduled[i]), int(computed[i])
            rows = hidden[start:start + n]
            last = done + n >= int(prompt_lens[i])
            if kind == "LAST":
                vec = rows[-1].float() if last else None
            else:
                if done == 0:
                    self._partial[rid] = (rows.float().sum(0) if kind == "MEAN"
                                          else rows[0].float())
                elif rid not in self._partial:
                    raise RuntimeError(f"request {rid!r}: its first {done} prompt tokens were "
                                       f"not computed here; {kind} pooling needs them (is "
                                       "prefix caching on?)")
                elif kind == "MEAN":
                    self._partial[rid] += rows.float().sum(0)
                vec = None
                if last:
                    vec = self._partial.pop(rid)
                    if kind == "MEAN":
                        vec = vec / int(prompt_lens[i])
            if vec is not None:
                if self.spec.normalize:
                    vec = torch.nn.functional.normalize(vec, dim=-1)
                pooled[rid] = vec.cpu().tolist()
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids],
                                 pooler_output=pooled)
