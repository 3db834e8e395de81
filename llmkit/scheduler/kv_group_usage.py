"""Per KV-cache group usage for the stats snapshot (``SchedulerStats.kv_usage_by_group``).

The manager's ``kv_usage_by_group()`` maps each group (``"<index>:<spec>"``, e.g. ``"0:full"``)
to the fraction of the pool its requests hold. With one group that is the pool's usage (O(1));
with several it walks the blocks held, so it is recomputed at most every
``MIN_INTERVAL_S`` of wall time and the last figures are reported in between: the snapshot is
made every step, its readers (``/metrics``, the engine page) look a few times a second.
"""
from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["KVGroupUsage", "MIN_INTERVAL_S"]

MIN_INTERVAL_S = 0.25


class KVGroupUsage:
    def __init__(self, kv: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self._last: dict[str, float] = {}
        self._at = -float("inf")

    def __call__(self) -> dict[str, float]:
        kv = self.kv
        by_group = kv.kv_usage_by_group
        if kv.num_groups <= 1:
            return by_group()
        now = self.clock()
        if now - self._at >= MIN_INTERVAL_S:
            self._last, self._at = by_group(), now
        return dict(self._last)
