"""A settable clock and a linear stand-in step cost for SLO scheduler tests."""
from __future__ import annotations


def linear_step_time(work, stream_rate: float = 0.0) -> float:
    """10 ms per step + 1 ms per token computed (the front end's share is left out)."""
    return 0.010 + 0.001 * sum(q for q, _, _ in work)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
