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

``StepSummaryPublisher`` is the only part that runs inside the engine core. It takes
``EngineCore``'s step hooks (the ``StepTrace`` protocol: ``begin_step``, ``scheduled``,
``executed``, ``end_step``, ``close``) and forwards them to the core's own trace if one is set.
It reads the scheduler and KV manager through their public methods plus the scheduler's
``requests`` table; this is the piece to re-base on the engine's observer API (step hooks that
receive the ``SchedulerOutput``, timings and stats) once that lands.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from llmkit.engine.step_trace import split_prefill_decode
from llmkit.request import RequestStatus

__all__ = ["EngineSnapshotQuery", "EngineStepSummary", "MAX_LISTED_REQUESTS", "RequestSummary",
           "StepSummaryPublisher"]

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


_STATUS_NAMES = {RequestStatus.WAITING: "waiting", RequestStatus.WAITING_FOR_FSM: "waiting",
                 RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}


class StepSummaryPublisher:
    """Builds summaries from the engine core's step hooks and hands them to ``send`` at most
    ``max_per_s`` times a second (see the module docstring)."""

    def __init__(self, core: Any, send: Callable[[EngineStepSummary], None], max_per_s: float,
                 *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.core = core
        self.send = send
        self.enabled = max_per_s > 0
        self.interval = 1.0 / max_per_s if max_per_s > 0 else float("inf")
        self.clock = clock
        # The core's own trace (observability.trace_file) keeps getting every hook.
        self.inner = core.step_trace
        self.step = 0
        self.total_tokens = 0
        self._t0 = 0.0
        self._out: Any = None
        self._last_sent = -float("inf")
        self._skipped = self._skipped_tokens = 0
        self._dirty = False  # state changed since the last summary

    def install(self) -> "StepSummaryPublisher":
        self.core.step_trace = self
        return self

    # -- the StepTrace hooks EngineCore.step() calls, in order ------------------------------
    def begin_step(self) -> None:
        self._t0 = self.clock()
        if self.inner is not None:
            self.inner.begin_step()

    def scheduled(self, scheduler_output: Any, scheduler: Any) -> None:
        self._out = scheduler_output
        if self.inner is not None:
            self.inner.scheduled(scheduler_output, scheduler)

    def executed(self) -> None:
        if self.inner is not None:
            self.inner.executed()

    def end_step(self, scheduler: Any) -> None:
        if self.inner is not None:
            self.inner.end_step(scheduler)
        out, self._out = self._out, None
        if out is None:
            return
        self.step += 1
        self.total_tokens += out.total_num_scheduled_tokens
        now = self.clock()
        # The prefill/decode split costs a pass over the batch: only published steps pay it.
        if self.enabled and now - self._last_sent >= self.interval:
            self._last_sent = now
            self.send(self.summary(out, step_ms=1e3 * (now - self._t0)))
        else:
            self._skipped += 1
            self._skipped_tokens += out.total_num_scheduled_tokens
            self._dirty = True

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

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
                self.core.kv_cache_manager.check_integrity()
            except AssertionError as e:  # KVCacheIntegrityError
                s.kv_integrity_error = str(e) or type(e).__name__
        return s

    # -- building one -----------------------------------------------------------------------
    def summary(self, out: Any | None, step_ms: float = 0.0) -> EngineStepSummary:
        core = self.core
        scheduler = core.scheduler
        kv = core.kv_cache_manager
        stats = scheduler.stats()
        s = EngineStepSummary(step=self.step, time=time.time(), step_ms=step_ms,
                              steps_skipped=self._skipped, tokens_skipped=self._skipped_tokens)
        self._skipped = self._skipped_tokens = 0
        self._dirty = False
        if out is not None:
            pr, pt, dr, dt, _, _ = split_prefill_decode(out, getattr(scheduler, "get_request",
                                                                     None))
            s.num_scheduled_tokens = out.total_num_scheduled_tokens
            s.num_prefill_tokens, s.num_prefill_reqs = pt, pr
            s.num_decode_tokens, s.num_decode_reqs = dt, dr
            s.num_preempted = len(out.preempted_req_ids)
        s.total_scheduled_tokens = self.total_tokens
        s.num_running, s.num_waiting = stats.num_running, stats.num_waiting
        s.kv_usage = float(stats.kv_usage)
        s.prefix_cache_queries = stats.prefix_cache_queries
        s.prefix_cache_hits = stats.prefix_cache_hits
        s.num_preemptions_total = stats.num_preemptions_total
        s.num_blocks = kv.num_blocks
        s.num_free_blocks = kv.num_free_blocks
        s.num_held_blocks = kv.num_blocks - kv.num_free_blocks
        s.num_cached_blocks = getattr(kv, "num_prefix_cached_blocks", 0)
        s.requests, s.num_requests_omitted = self._requests(scheduler, kv)
        return s

    @staticmethod
    def _requests(scheduler: Any, kv: Any) -> tuple[list[RequestSummary], int]:
        table = getattr(scheduler, "requests", None) or {}
        listed: list[RequestSummary] = []
        reqs = sorted(table.values(), key=lambda r: (r.status != RequestStatus.RUNNING, r.arrival_index))
        for req in reqs[:MAX_LISTED_REQUESTS]:
            listed.append(RequestSummary(
                request_id=req.request_id, status=_STATUS_NAMES.get(req.status, "finished"),
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed_tokens=req.num_computed_tokens,
                num_output_tokens=req.num_output_tokens,
                num_blocks=len(kv.get_block_ids(req.request_id))))
        return listed, max(len(reqs) - MAX_LISTED_REQUESTS, 0)
