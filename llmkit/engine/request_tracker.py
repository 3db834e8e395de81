"""``RequestTracker``: the engine requests of an ``AsyncLLM`` in flight, as this process follows
them; ``RequestStream``: one request's outputs as an async iterator, which the tracker fills and
ends (it keeps the stream's queue and count of live samples).

It routes the engine's outputs (through the ``OutputProcessor``) to the requests' streams, ends
streams on abort, refusal or engine death, counts the engine requests that wait for their first
token (``AsyncLLM``'s admission limit) and feeds the ``StatLogger``. It runs in the event loop
only; ``AsyncLLM`` hands it the client's messages from the reader thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from llmkit.engine.client import EngineProcessClient
from llmkit.engine.process.core import EngineCoreOutputs
from llmkit.engine.output_processor import OutputProcessor
from llmkit.engine.observe.stat_logger import StatLogger
from llmkit.outputs import (EmbeddingRequestOutput, EngineCoreOutput, RequestOutput,
                            is_slo_rejection)
from llmkit.scheduler.base import SchedulerStats

__all__ = ["RequestStream", "RequestTracker"]

logger = logging.getLogger(__name__)


class StreamOwner(Protocol):
    """Who follows the stream's engine requests (``RequestTracker``); the stream only asks it
    to abort them."""

    def abort_local(self, request_ids: list[str]) -> None: ...


class SLORejectedError(ValueError):
    """The SLO scheduler refused the request (``scheduler.slo_admission=reject``): it was
    predicted to miss its SLO. The message says why; the server answers 429."""


def _slo_rejection(ro: RequestOutput | EmbeddingRequestOutput) -> SLORejectedError | None:
    """A finished output whose every sample the SLO scheduler refused, as the error its stream
    raises (None otherwise). A pooling request's output holds one embedding, no samples."""
    if not isinstance(ro, RequestOutput):
        return None
    # (finish_reason first: an output that did not abort costs no call)
    if ro.outputs and all(c.finish_reason == "abort" and not c.token_ids
                          and is_slo_rejection(c.finish_reason, c.stop_reason)
                          for c in ro.outputs):
        return SLORejectedError(str(ro.outputs[0].stop_reason))
    return None


class RequestStream:
    """The outputs of one request (all its ``n`` samples merged by the output processor:
    ``outputs[i].index`` is the sample), as an async iterator.

    Ends after the output with ``finished=True``; raises ``EngineDeadError`` if the engine
    dies, ``ValueError`` if the engine refused the request (``SLORejectedError`` when the SLO
    scheduler did). ``abort()`` (sync, idempotent)
    stops the request; the stream then ends with an output whose finish_reason is ``"abort"``.
    """

    def __init__(self, owner: StreamOwner, request_id: str, child_ids: list[str]) -> None:
        self.request_id = request_id
        self.child_ids = child_ids
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._live = len(child_ids)  # engine requests not finished yet
        self._done = False  # the consumer has seen the end
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self._live == 0

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Stop every unfinished sample of this request (no-op once finished)."""
        if self._live:
            self._owner.abort_local(self.child_ids)

    async def aclose(self) -> None:
        self.abort()


@dataclass(slots=True)
class _Tracked:
    """One engine request (a child, when n > 1) as this process follows it."""

    request_id: str
    stream: RequestStream
    arrival: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestTracker:
    """The engine requests in flight and their streams (see the module docstring)."""

    def __init__(self, processor: OutputProcessor, engine_core: EngineProcessClient,
                 stat_logger: StatLogger | None) -> None:
        self.processor = processor
        self.engine_core = engine_core
        self.stat_logger = stat_logger
        self.last_stats: SchedulerStats | None = None
        self.tracked: dict[str, _Tracked] = {}  # by engine request id
        self.streams: dict[str, RequestStream] = {}  # by the caller's request id
        self.num_pending = 0  # engine requests without a first token yet

    def open(self, stream: RequestStream) -> None:
        self.streams[stream.request_id] = stream

    def track(self, request_id: str, stream: RequestStream, num_prompt_tokens: int) -> None:
        """Follow engine request ``request_id`` (one of ``stream``'s children)."""
        self.tracked[request_id] = _Tracked(request_id, stream, stream.arrival_time,
                                            num_prompt_tokens)
        self.num_pending += 1

    def on_stats(self, stats: SchedulerStats) -> None:
        self.last_stats = stats
        if self.stat_logger is not None:
            self.stat_logger.on_scheduler_stats(stats)

    def handle_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            self.on_stats(msg.stats)
        now = time.monotonic()
        stat = self.stat_logger
        for rid, err in msg.errors.items():
            t = self.tracked.get(rid)
            if t is not None:
                self._finish(t, "error", now, None)
                self.drop_processor_state([rid])
                self._forget_stream(t.stream)
                t.stream._put(ValueError(f"the engine refused the request: {err}"))
                self.abort_local(t.stream.child_ids)  # its siblings, if n > 1
        for eco in msg.outputs:
            t = self.tracked.get(eco.request_id)
            n_new = len(eco.new_token_ids)
            if t is None or not n_new:
                continue
            if t.first_token_time is None:
                t.first_token_time = now
                if t.stream.first_token_time is None:
                    t.stream.first_token_time = now
                self.num_pending -= 1
                if stat is not None:
                    stat.on_first_token(now - t.arrival, t.num_prompt_tokens)
                    stat.on_new_tokens(1, None)
                    if n_new > 1:
                        stat.on_new_tokens(n_new - 1, 0.0)
            elif stat is not None:
                stat.on_new_tokens(n_new, now - (t.last_token_time or now))
            t.last_token_time = now
            t.num_generation_tokens += n_new
        # Children finished here by a stop string; the engine core still runs them.
        stopped: list[str] = []
        request_outputs = self.processor.process(msg.outputs, stopped)
        if stopped:
            self.engine_core.abort_requests(stopped)
        finished = {eco.request_id: eco.finish_reason for eco in msg.outputs
                    if eco.finish_reason is not None}
        finished.update((rid, "stop") for rid in stopped)
        for rid, reason in finished.items():
            t = self.tracked.get(rid)
            if t is not None:
                timing = msg.timings.get(rid)
                self._finish(t, reason, now, timing.queue_time if timing else None)
        for ro in request_outputs:
            stream = self.streams.get(ro.request_id)
            if stream is None:
                continue
            if ro.finished:
                self._forget_stream(stream)
                first = stream.first_token_time
                ro.metrics.update(arrival_time=stream.arrival_time, first_token_time=first,
                                  finished_time=now,
                                  time_to_first_token=None if first is None
                                  else first - stream.arrival_time)
                rejected = _slo_rejection(ro)
                if rejected is not None:
                    stream._put(rejected)
                    continue
            stream._put(ro)

    def _finish(self, t: _Tracked, reason: str, now: float, queue_time: float | None) -> None:
        self.tracked.pop(t.request_id, None)
        if t.first_token_time is None:
            self.num_pending -= 1
        t.stream._live -= 1
        if self.stat_logger is not None:
            self.stat_logger.on_finished(reason, now - t.arrival, queue_time,
                                         t.num_prompt_tokens, t.num_generation_tokens)

    def drop_processor_state(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish engine requests in the output processor as the engine does for an abort."""
        return self.processor.process([EngineCoreOutput(rid, [], finish_reason="abort")
                                       for rid in request_ids])

    def abort_local(self, request_ids: list[str]) -> None:
        """Abort engine requests now: their streams end with a final "abort" output, and the
        engine core frees their blocks before its next step."""
        ids = [rid for rid in request_ids if rid in self.tracked]
        if not ids:
            return
        now = time.monotonic()
        for rid in ids:
            self._finish(self.tracked[rid], "abort", now, None)
        for ro in self.drop_processor_state(ids):
            stream = self.streams.get(ro.request_id)
            if stream is not None:
                if ro.finished:
                    self._forget_stream(stream)
                stream._put(ro)
        try:
            self.engine_core.abort_requests(ids)
        except Exception:  # noqa: BLE001 - a dead or closed engine frees nothing anyway
            logger.debug("abort of %s not sent", ids, exc_info=True)

    def _forget_stream(self, stream: RequestStream) -> None:
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    def fail_requests(self, request_ids: list[str], err: BaseException) -> None:
        """End the streams of these engine requests with ``err`` (their data-parallel engine
        core died); a stream's other samples, if any, are aborted."""
        streams = {id(t.stream): t.stream for rid in request_ids
                   if (t := self.tracked.get(rid)) is not None}
        now = time.monotonic()
        lost = [rid for s in streams.values() for rid in s.child_ids if rid in self.tracked]
        for rid in lost:
            self._finish(self.tracked[rid], "error", now, None)
        if lost:
            self.drop_processor_state(lost)
        for stream in streams.values():
            self._forget_stream(stream)
            stream._put(err)
        others = [rid for rid in lost if rid not in set(request_ids)]
        if others:
            try:
                self.engine_core.abort_requests(others)
            except Exception:  # noqa: BLE001
                logger.debug("abort of %s not sent", others, exc_info=True)

    def fail_all(self, err: BaseException) -> None:
        """End every stream in flight with ``err`` (the engine died or is shutting down)."""
        tracked = list(self.tracked.values())
        now = time.monotonic()
        for t in tracked:
            self._finish(t, "error", now, None)
        if tracked:
            try:
                self.drop_processor_state([t.request_id for t in tracked])
            except Exception:  # noqa: BLE001
                logger.debug("dropping output state failed", exc_info=True)
        for stream in {id(t.stream): t.stream for t in tracked}.values():
            self._forget_stream(stream)
            stream._put(err)
