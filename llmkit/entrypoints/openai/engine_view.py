"""The engine's live state over HTTP: ``GET /v1/engine/stats`` (JSON) and
``GET /v1/engine/events`` (server-sent events), what the ``/engine`` page shows. Both need the
API key like the rest of ``/v1``.

``/v1/engine/stats`` answers ``{"engine": {...}, "latest": SUMMARY | null, "recent": [...]}``:
``engine`` has ``up``, ``restarting``, ``restarts``, ``pid``, ``num_blocks``, ``block_size``,
``max_model_len``, ``events_per_s``; ``latest`` is the engine core's most recent step summary
(``llmkit/engine/observe/step_summary.py`` defines every field); ``recent`` the last ``history``
summaries (0 by default, at most 256). ``?fresh=true`` asks the engine core for its state now
instead of the latest published step; ``?check_kv=true`` (implies fresh) also runs the KV
cache's integrity check: ``latest.kv_checked`` is true and ``latest.kv_integrity_error`` is
null when every block's reference count, free list and hash entry agree. With no request in
flight, ``latest.num_held_blocks`` is the number of leaked blocks (pinned prefixes excepted).

``/v1/engine/events`` sends one ``event: step`` per published summary (the engine core
publishes at most ``server.engine_events_per_s`` a second; steps in between are counted in
``steps_skipped``), starting with the latest one, a ``: ping`` comment every 15 s while the
engine is idle, and ``event: error`` with OpenAI's error body when the engine dies, after which
the stream ends.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from fastapi import FastAPI, Query

from llmkit.engine.async_llm import AsyncLLM, EngineDeadError
from llmkit.entrypoints.openai.errors import OpenAIError, engine_dead
from llmkit.entrypoints.openai.protocol import ErrorResponse
from llmkit.entrypoints.openai.streaming import EngineStreamingResponse

__all__ = ["add_engine_view_routes", "summary_json"]

PING_INTERVAL_S = 15.0

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    500: {"model": ErrorResponse, "description": "The engine is not running"},
    504: {"model": ErrorResponse, "description": "The engine did not answer in time"},
}


def summary_json(summary: Any) -> dict[str, Any] | None:
    if summary is None:
        return None
    d = msgspec.to_builtins(summary)
    d.pop("type", None)  # msgspec's union tag and the query's id: internal
    d.pop("query_id", None)
    return d


def engine_facts(engine: AsyncLLM, events_per_s: float) -> dict[str, Any]:
    ready = engine.engine_core.ready  # set: AsyncLLM waited for it
    return {"up": engine.is_running, "restarting": engine.restarting,
            "restarts": engine.num_engine_restarts, "pid": ready.pid,
            "num_blocks": ready.num_blocks, "block_size": ready.block_size,
            "max_model_len": engine.max_model_len, "events_per_s": events_per_s}


def add_engine_view_routes(app: FastAPI, engine: AsyncLLM, *, events_per_s: float) -> None:
    @app.get("/v1/engine/stats", responses=_ERRORS)
    async def engine_stats(fresh: bool = False, check_kv: bool = False,
                           history: int = Query(0, ge=0, le=256)) -> dict[str, Any]:
        """The engine core's latest step summary (``fresh``: its state now; ``check_kv``:
        with the KV cache's integrity check) and recent ones."""
        feed = engine.step_feed
        latest = feed.latest
        if fresh or check_kv:
            try:
                latest = await engine.engine_snapshot(check_kv=check_kv)
            except EngineDeadError as e:
                raise engine_dead(e) from None
            except TimeoutError:
                raise OpenAIError(504, "the engine core did not answer within 10 s",
                                  type="server_error", code="engine_timeout") from None
        recent = list(feed.recent)[-history:] if history else []
        return {"engine": engine_facts(engine, events_per_s), "latest": summary_json(latest),
                "recent": [summary_json(s) for s in recent]}

    @app.get("/v1/engine/events", responses={
        **_ERRORS, 200: {"description": "Server-sent events", "content": {
            "text/event-stream": {}}}})
    async def engine_events():
        """Server-sent events: one ``step`` event per published step summary."""
        if not engine.is_running:
            raise engine_dead(engine.dead_error)
        feed = engine.step_feed
        queue = feed.subscribe()

        async def events():
            try:
                if feed.latest is not None:
                    yield _event("step", summary_json(feed.latest))
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), PING_INTERVAL_S)
                    except TimeoutError:
                        yield ": ping\n\n"
                        continue
                    if isinstance(item, BaseException):
                        yield _event("error", engine_dead(item).body())
                        return
                    yield _event("step", summary_json(item))
            finally:
                feed.unsubscribe(queue)

        return EngineStreamingResponse(events(), on_close=lambda: feed.unsubscribe(queue))


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
