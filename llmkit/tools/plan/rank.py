"""The order of ``llmkit plan``'s candidates: goodput first (requests/s that met every SLO
set), then cost (output tokens per core-second: more is cheaper), then the search's order, so
the same predictions always rank the same. Candidates that failed come last."""
from __future__ import annotations

from typing import Sequence

from llmkit.tools.plan.runner import Prediction

__all__ = ["rank"]


def rank(preds: Sequence[Prediction]) -> list[Prediction]:
    order = {id(p): i for i, p in enumerate(preds)}
    return sorted(preds, key=lambda p: (p.error is not None, -round(p.goodput, 9),
                                        -round(p.tokens_per_core_s, 9), order[id(p)]))
