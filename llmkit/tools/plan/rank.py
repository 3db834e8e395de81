"""The order of ``llmkit plan``'s candidates: goodput first (requests/s that met every SLO
set), then cost (output tokens per core-second: more is cheaper), then the search's order, so
the same predictions always rank the same. Candidates that failed come last.

The verified candidates are ranked again by what ``bench serve`` measured, by the same keys
(``rank_measured``): the recipe is the best measured one, whatever the simulator predicted."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from llmkit.tools.plan.runner import Prediction

__all__ = ["measured_tokens_per_core_s", "rank", "rank_measured"]


def rank(preds: Sequence[Prediction]) -> list[Prediction]:
    order = {id(p): i for i, p in enumerate(preds)}
    return sorted(preds, key=lambda p: (p.error is not None, -round(p.goodput, 9),
                                        -round(p.tokens_per_core_s, 9), order[id(p)]))


def measured_tokens_per_core_s(summary: Mapping[str, Any], cores: int) -> float:
    """The measured cost: output tokens per core-second of a ``bench serve`` summary."""
    duration = summary.get("duration_s") or 0.0
    if not duration:
        return 0.0
    return summary.get("total_output_tokens", 0) / (duration * max(cores, 1))


def rank_measured(ranked: Sequence[Prediction],
                  measured: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """The verified candidates' indices into ``ranked``, best measured first: measured goodput,
    then measured tokens per core-second, then the predicted rank."""
    return sorted(measured, key=lambda i: (
        -round(float(measured[i]["goodput"]), 9),
        -round(measured_tokens_per_core_s(measured[i], ranked[i].cores), 9), i))
