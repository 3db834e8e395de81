"""The stats of several data-parallel engine cores as one ``SchedulerStats``.

Counts and counters add up over the cores (running, waiting, preemptions, prefix-cache
queries and hits, spec-decode and encoder-cache counters, per-adapter counts, KV connector
counters); ``kv_usage`` is the fraction of *all* the cores' KV blocks in use (each core's
usage weighted by its pool's size), and so is each KV-cache group's ``kv_usage_by_group``.
A core that has not reported yet counts as idle.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from llmkit.scheduler.base import SchedulerStats

__all__ = ["combine_scheduler_stats"]


def combine_scheduler_stats(stats: Sequence[SchedulerStats | None],
                            num_blocks: Sequence[int]) -> SchedulerStats | None:
    present = [(s, n) for s, n in zip(stats, num_blocks) if s is not None]
    if not present:
        return None
    total = _sum([s for s, _ in present])
    blocks = sum(num_blocks)
    total.kv_usage = (sum(s.kv_usage * n for s, n in present) / blocks if blocks else
                      max(s.kv_usage for s, _ in present))
    if blocks:  # each group's share of all the cores' blocks
        total.kv_usage_by_group = {
            g: sum(s.kv_usage_by_group.get(g, 0.0) * n for s, n in present) / blocks
            for g in total.kv_usage_by_group}
    return total


def _sum(values: list[Any]) -> Any:
    """Field-wise sum of values of one kind (dataclasses recursively, dicts by key, lists by
    position); ``None`` values are skipped."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    if dataclasses.is_dataclass(first):
        fields = {f.name: _sum([getattr(v, f.name) for v in values])
                  for f in dataclasses.fields(first) if f.init}
        return type(first)(**fields)
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list):
        width = max(len(v) for v in values)
        return [_sum([v[i] for v in values if i < len(v)]) for i in range(width)]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        return sum(values)
    return first  # strings and the like: the first core's
