"""The simulator's clock: virtual seconds that advance by each step's modelled cost.

``EngineCore`` and the scheduler take any ``clock: () -> float``; handing them a
``VirtualClock`` makes every timestamp they record (``Request.times``: first scheduled, each
token, finished) a virtual one. The sim executor advances it by each step's cost after the
scheduler has timestamped the step's start, and before ``update_from_output`` timestamps the
tokens, so a token's time is the end of the step that produced it — as on real hardware.
"""
from __future__ import annotations

__all__ = ["VirtualClock"]


class VirtualClock:
    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (advance by {seconds})")
        self._now += seconds
        return self._now

    def advance_to(self, t: float) -> float:
        """Move forward to ``t`` if it is later (idle time: nothing to run until then)."""
        if t > self._now:
            self._now = float(t)
        return self._now

    def __repr__(self) -> str:
        return f"VirtualClock({self._now:.6f})"
