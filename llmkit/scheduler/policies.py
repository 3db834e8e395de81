"""Small policies the token-budget scheduler is parameterised by: the order of the waiting queue
and the choice of a preemption victim."""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from typing import Iterator

from llmkit.request import Request


class WaitingQueue(ABC):
    """Requests waiting for admission, in the order the policy admits them."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """A preempted request goes back; it should run again before newer work."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(WaitingQueue):
    """Lower ``priority`` first, then earlier arrival; a preempted request keeps its place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._removed: set[int] = set()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_index, request))

    add_preempted = add

    def _clean(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def peek(self) -> Request:
        self._clean()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._clean()
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))
        self._clean()

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, _, r in sorted(self._heap, key=lambda e: e[:2])
                if id(r) not in self._removed)


WAITING_QUEUES: dict[str, type[WaitingQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt when KV blocks run out.

    ``lifo``: the most recently admitted (it has waited least and usually holds least).
    ``fewest_computed_tokens``: the one whose recomputation costs least.
    """
    if policy == "lifo":
        return running[-1]
    if policy == "fewest_computed_tokens":
        # Ties go to the most recently admitted, as under lifo.
        return min(reversed(running), key=lambda r: r.num_computed_tokens)
    raise ValueError(f"scheduler.preemption_policy: got {policy!r}; allowed: lifo, "
                     "fewest_computed_tokens")
