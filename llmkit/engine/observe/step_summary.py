"""Compact per-step summaries of the engine core, for live views (``/engine``,
``GET /v1/engine/events``) and for checks (``GET /v1/engine/stats?fresh=true``).

The engine core process publishes an ``EngineStepSummary`` after a step at most
``server.engine_events_per_s`` times a second: the steps in between are counted
(``steps_skipped``, ``tokens_skipped``), not sent. When the engine goes idle it publishes the
state it left (nothing running, the blocks freed), so a view never stays on a stale step.

A summary says what one step did (prefill vs decode tokens and requests, preemptions, its
duration) and the state after it: running/waiting counts, the KV pool (blocks free, held,
holding a cached prefix), prefix-cache counters, and up to ``MAX_LISTED_REQUESTS`` requests
with the blocks each holds.

``StepSummaryPublisher`` is the only part that runs inside the engine core: an observer of its
steps (``engine/observe/observer.py``) that reads the core through its public accessors
(``stats()``, ``request_states()``, ``kv_state()``, ``check_kv_integrity()``).
``EngineStepFeed`` is where they arrive in the API process.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any, Callable

import msgspec

from llmkit.engine.observe.observer import StepEvent

__all__ = ["EngineSnapshotQuery", "EngineStepFeed", "EngineStepSummary", "MAX_LISTED_REQUESTS",
           "RequestSummary", "StepSummaryPublisher"]

# Requests listed per summary (running first); the rest are counted in num_requests_omitted.
MAX_LISTED_REQUESTS = 64


class RequestSummary(msgspec.Struct):
    request_id: str
    status: str  # "running" | "waiting" | "preempted"
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int  # KV blocks the request holds now


class EngineStepSummary(msgspec.Struct, tag="step"):
    """One step's work and the engine's state after it (or, with ``step_ms`` 0 and no tokens,
    a snapshot of the state between steps)."""

    step: int  # engine steps run since start-up (this one included)
    time: float  # wall clock (Unix seconds) when the summary was made
    step_ms: float = 0.0  # schedule + execute + update of this step
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_preempted: int = 0  # preempted in this step
    # Steps since the previous summary that were not published, and the tokens they scheduled.
    steps_skipped: int = 0
    tokens_skipped: int = 0
    # State after the step.
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0  # allocatable: empty, or cached and evictable
    num_held_blocks: int = 0  # held by requests (a shared block counts once) or pinned
    num_cached_blocks: int = 0  # holding a full block of a cached prefix, held or free
    kv_usage: float = 0.0
    # per KV-cache group ("<index>:<spec>"): the fraction of the pool its requests hold
    kv_usage_by_group: dict[str, float] = {}
    prefix_cache_queries: int = 0  # cumulative tokens looked up / served from the cache
    prefix_cache_hits: int = 0
    num_preemptions_total: int = 0
    total_scheduled_tokens: int = 0  # over every step since start-up
    requests: list[RequestSummary] = []
    num_requests_omitted: int = 0
    # Set on the answer to an EngineSnapshotQuery.
    query_id: int | None = None
    # KVCacheManager.check_integrity() ran (kv_checked) and what it found (None = consistent).
    kv_checked: bool = False
    kv_integrity_error: str | None = None


class EngineSnapshotQuery(msgspec.Struct, array_like=True, tag="snapshot"):
    """Ask the engine core for a summary of its state now (answered between steps), with
    ``KVCacheManager.check_integrity()`` when ``check_kv``."""

    query_id: int
    check_kv: bool = False




class StepSummaryPublisher:
    """Builds summaries from the engine core's steps and hands them to ``send`` at most
    ``max_per_s`` times a second (see the module docstring)."""

    def __init__(self, core: Any, send: Callable[[EngineStepSummary], None], max_per_s: float,
                 *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.core = core
        self.send = send
        self.enabled = max_per_s > 0
        self.interval = 1.0 / max_per_s if max_per_s > 0 else float("inf")
        self.clock = clock
        self.step = 0
        self.total_tokens = 0
        self._last_sent = -float("inf")
        self._skipped = self._skipped_tokens = 0
        self._dirty = False  # state changed since the last summary

    def install(self) -> "StepSummaryPublisher":
        self.core.add_step_observer(self)
        return self

    def on_step(self, event: StepEvent) -> None:
        out = event.scheduler_output
        self.step += 1
        self.total_tokens += out.total_num_scheduled_tokens
        now = self.clock()
        if self.enabled and now - self._last_sent >= self.interval:
            self._last_sent = now
            self.send(self.summary(event))
        else:
            self._skipped += 1
            self._skipped_tokens += out.total_num_scheduled_tokens
            self._dirty = True

    # -- between steps ----------------------------------------------------------------------
    def state_changed(self) -> None:
        """Requests were added or aborted outside a step."""
        self._dirty = True

    def flush(self) -> None:
        """Publish the current state if it changed since the last summary (the engine core
        calls this when it goes idle)."""
        if self.enabled and self._dirty:
            self._last_sent = self.clock()
            self.send(self.summary(None))

    def snapshot(self, query: EngineSnapshotQuery) -> EngineStepSummary:
        s = self.summary(None)
        s.query_id = query.query_id
        if query.check_kv:
            s.kv_checked = True
            try:
                self.core.check_kv_integrity()
            except AssertionError as e:  # KVCacheIntegrityError
                s.kv_integrity_error = str(e) or type(e).__name__
        return s

    # -- building one -----------------------------------------------------------------------
    def summary(self, event: StepEvent | None) -> EngineStepSummary:
        core = self.core
        stats = event.stats if event is not None else core.stats()
        step_ms = 1e3 * event.step_s if event is not None else 0.0
        s = EngineStepSummary(step=self.step, time=time.time(), step_ms=step_ms,
                              steps_skipped=self._skipped, tokens_skipped=self._skipped_tokens)
        self._skipped = self._skipped_tokens = 0
        self._dirty = False
        if event is not None:
            out, split = event.scheduler_output, event.split
            s.num_scheduled_tokens = out.total_num_scheduled_tokens
            s.num_prefill_tokens, s.num_prefill_reqs = split.prefill_tokens, split.prefill_reqs
            s.num_decode_tokens, s.num_decode_reqs = split.decode_tokens, split.decode_reqs
            s.num_preempted = len(out.preempted_req_ids)
        s.total_scheduled_tokens = self.total_tokens
        s.num_running, s.num_waiting = stats.num_running, stats.num_waiting
        s.kv_usage = float(stats.kv_usage)
        s.kv_usage_by_group = {g: float(u) for g, u in stats.kv_usage_by_group.items()}
        s.prefix_cache_queries = stats.prefix_cache_queries
        s.prefix_cache_hits = stats.prefix_cache_hits
        s.num_preemptions_total = stats.num_preemptions_total
        kv = core.kv_state()
        s.num_blocks = kv.num_blocks
        s.num_free_blocks = kv.num_free_blocks
        s.num_held_blocks = kv.num_blocks - kv.num_free_blocks
        s.num_cached_blocks = kv.num_prefix_cached_blocks
        states = core.request_states()
        s.requests = [RequestSummary(request_id=r.request_id, status=r.status,
                                     num_prompt_tokens=r.num_prompt_tokens,
                                     num_computed_tokens=r.num_computed_tokens,
                                     num_output_tokens=r.num_output_tokens,
                                     num_blocks=r.num_blocks)
                      for r in states[:MAX_LISTED_REQUESTS]]
        s.num_requests_omitted = max(len(states) - MAX_LISTED_REQUESTS, 0)
        return s


# -- in the API process ----------------------------------------------------------------------
# ``EngineStepFeed``: the engine core's step summaries as this (API) process keeps them — the
# latest one, a ring of recent ones, live subscribers, and the answers to snapshot queries.
#
# It runs in the event loop only (``AsyncLLM`` hands it the client's messages from the reader
# thread). A subscriber that reads too slowly loses its oldest summaries, never blocks the feed.
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
