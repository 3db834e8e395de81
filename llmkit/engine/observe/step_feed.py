"""``EngineStepFeed``: the engine core's step summaries as this (API) process keeps them — the
latest one, a ring of recent ones, live subscribers, and the answers to snapshot queries.

It runs in the event loop only (``AsyncLLM`` hands it the client's messages from the reader
thread). A subscriber that reads too slowly loses its oldest summaries, never blocks the feed.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
from llmkit.engine.observe.step_summary import EngineStepSummary

__all__ = ["EngineStepFeed"]


class EngineStepFeed:
    def __init__(self, history: int = 256, subscriber_queue: int = 64) -> None:
        self.latest: EngineStepSummary | None = None
        self.recent: collections.deque[EngineStepSummary] = collections.deque(maxlen=history)
        self.num_published = 0
        self._subscriber_queue = subscriber_queue
        self._subscribers: set[asyncio.Queue] = set()
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count(1)

    # -- in -------------------------------------------------------------------------------
    def publish(self, summary: EngineStepSummary) -> None:
        if summary.query_id is not None:
            fut = self._queries.pop(summary.query_id, None)
            if fut is not None and not fut.done():
                fut.set_result(summary)
            return
        self.latest = summary
        self.recent.append(summary)
        self.num_published += 1
        for q in self._subscribers:
            if q.full():
                q.get_nowait()  # a slow reader drops its oldest
            q.put_nowait(summary)

    def fail(self, err: BaseException) -> None:
        """The engine died: pending queries fail, subscribers see the end."""
        queries, self._queries = self._queries, {}
        for fut in queries.values():
            if not fut.done():
                fut.set_exception(err)
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
            q.put_nowait(err)

    # -- out ------------------------------------------------------------------------------
    def new_query(self, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future]:
        qid = next(self._query_ids)
        fut = loop.create_future()
        self._queries[qid] = fut
        return qid, fut

    def drop_query(self, qid: int) -> None:
        self._queries.pop(qid, None)

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives every summary published from now on, and the engine's death
        error (an exception instance) if it dies; ``unsubscribe`` it when done."""
        q: asyncio.Queue = asyncio.Queue(self._subscriber_queue)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
