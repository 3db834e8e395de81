"""Arrival times of a workload, in seconds after the start (pure: the same arguments and seed
give the same times).

- ``poisson``: a Poisson process at ``rate`` requests/s — exponential gaps of mean ``1/rate``;
  the first request arrives at 0.
- ``constant``: exactly ``1/rate`` apart, from 0.
- ``burst`` (or ``rate=inf`` with any process): every request at 0.
"""
from __future__ import annotations

import math
import random

__all__ = ["ARRIVALS", "arrival_times"]

ARRIVALS = ("poisson", "constant", "burst")


def arrival_times(n: int, rate: float, arrival: str = "poisson", *,
                  seed: int | str = 0) -> list[float]:
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf = all at once), got {rate}")
    if arrival == "burst" or math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        return [i / rate for i in range(n)]
    rng = random.Random(f"arrivals-{seed}")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
