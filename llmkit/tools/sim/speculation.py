"""Speculative decoding in the simulator: the same ``speculative`` settings as a real engine,
with an acceptance model instead of a proposer and a verifier.

- **Acceptance model** (``speculative.acceptance_rates``): draft j of a run (0-based) is
  accepted with probability ``rates[j]`` (the last rate repeats) given that drafts 0..j-1
  were; the first rejected draft ends the run, and the target's own token follows, so a row
  verifying k drafts gains ``1 + accepted`` tokens.
- **Draft length**: the engine's own policy (``llmkit.spec_decode.adaptive``) with the ridge
  point of the modelled device: the tokens per forward at which the cost model's compute time
  reaches its memory time (``speculative.ridge_tokens`` overrides it).
- **Draft cost**: ``ngram`` drafts for free; ``draft_model`` prices the draft's catch-up pass
  and K - 1 one-token passes with the draft's shape (``speculative.model``: a named shape, a
  config.json or a model folder); ``eagle`` prices the same passes with one layer of the
  target's shape. Their KV adds to each block.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from llmkit.cost_model.step_cost import CostModel, SeqWork
from llmkit.spec_decode.adaptive import DraftLengthPolicy

__all__ = ["SimSpeculation", "ridge_tokens"]


def ridge_tokens(cost_model: CostModel, context_len: int = 512,
                 max_tokens: int = 1 << 16) -> int:
    """The smallest token count whose one-request step is compute-bound in ``cost_model``."""
    lo, hi = 1, max_tokens
    if cost_model.step([SeqWork(hi, context_len + hi, True)]).bound != "compute":
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if cost_model.step([SeqWork(mid, context_len + mid, True)]).bound == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo


class SimSpeculation:
    def __init__(self, spec: Any, target: CostModel, hardware: Any, dtype: str,
                 seed: int) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.rates = list(spec.acceptance_rates)
        self.ridge = spec.ridge_tokens or ridge_tokens(target)
        self.policy = DraftLengthPolicy(spec.adaptive, self.ridge if spec.adaptive else None,
                                        spec.disable_by_batch_size)
        self.draft_cost = self._draft_cost_model(spec, target, hardware, dtype)
        self._rng = random.Random(f"llmkit-sim-spec-{seed}")

    @staticmethod
    def _draft_cost_model(spec: Any, target: CostModel, hardware: Any,
                          dtype: str) -> CostModel | None:
        if spec.name == "eagle":
            shape = dataclasses.replace(target.shape, name=f"{target.shape.name}-eagle",
                                        num_layers=1)
        elif spec.name == "draft_model":
            from llmkit.cost_model.model_shape import load_shape
            shape = load_shape(spec.model)
        else:
            return None
        return CostModel(shape, hardware, dtype, target.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """The draft's KV per token and rank (it lives in the target's blocks)."""
        return self.draft_cost.kv_bytes_per_token if self.draft_cost is not None else 0

    def num_accepted(self, num_drafts: int) -> int:
        rates, rand = self.rates, self._rng.random
        a = 0
        while a < num_drafts and rand() < rates[min(a, len(rates) - 1)]:
            a += 1
        return a

    def num_drafts(self, num_rows: int, num_running: int) -> int:
        return self.policy.num_drafts(self.k, num_rows, num_running)

    def draft_time_s(self, catch_up: list[tuple[int, int]], drafting: list[tuple[int, int]]
                     ) -> float:
        """Seconds the draft takes after the target's step: its catch-up pass (per row:
        tokens, context after) and, per drafting row ``(k, context)``, k - 1 one-token passes
        (row count shrinking as shorter drafts finish)."""
        cm = self.draft_cost
        if cm is None or not catch_up:
            return 0.0
        total = cm.step([SeqWork(q, c, True) for q, c in catch_up]).total_s
        longest = max((k for k, _ in drafting), default=0)
        for j in range(1, longest):
            work = [SeqWork(1, c + j, True) for k, c in drafting if k > j]
            total += cm.step(work).total_s
        return total
