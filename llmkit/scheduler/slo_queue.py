"""The SLO scheduler's waiting queue: an order that the scheduler sets once per step.

Requests wait in a list; ``arrange(key)`` sorts it by the key the SLO policy computes at the
start of a step (resumed requests first, then by TTFT deadline, deferred ones last). Between
two arrangements new requests join at the end, and a request handed back by the admission
loop (``add_preempted``) goes to the front, so that requests passed over in a step return to
their places, ahead of what came after.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from llmkit.request import Request
from llmkit.scheduler.step_phases import WaitingQueue

__all__ = ["ArrangedQueue"]


class ArrangedQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: list[Request] = []

    def arrange(self, key: Callable[[Request], Any]) -> None:
        """Sort the queue by ``key`` (stable: equal keys keep their order)."""
        self._q.sort(key=key)

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.insert(0, request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.pop(0)

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._q))
