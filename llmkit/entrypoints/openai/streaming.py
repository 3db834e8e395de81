"""A request's engine streams, answered while the engine works and stopped when the client leaves.

One OpenAI request's engine requests (one per prompt) as a group: admitted all or none
(``admitting``), their final outputs (``collect``), their outputs as they come (``merge``), or
all aborted (``abort_all``). Server-sent-event responses (``sse``,
``EngineStreamingResponse``) that abort their requests however they end, and non-streaming
work cut short by a disconnect (``run_until_disconnect``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmkit.engine.async_llm import EngineDeadError, EngineOverloadedError, RequestStream
from llmkit.entrypoints.openai.errors import (bad_request, engine_dead, overloaded, param_of,
                                             refused)
from llmkit.outputs import RequestOutput

__all__ = ["EngineStreamingResponse", "abort_all", "admitting", "collect", "merge",
           "run_until_disconnect", "sse"]


def sse(data: dict | str) -> str:
    """One server-sent event (a JSON object, or a literal such as ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """A server-sent-event stream that calls ``on_close`` however it ends: finished, client
    gone (noticed at once, even while no token flows), or cancelled at shutdown."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        body = asyncio.ensure_future(self.stream_response(send))

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, watcher):
                if not task.done():
                    task.cancel()
            self._on_close()
            await asyncio.gather(body, watcher, return_exceptions=True)
        if body.done() and not body.cancelled() and body.exception() is not None \
                and not isinstance(body.exception(), OSError):
            raise body.exception()


async def run_until_disconnect(raw_request: Request, work, on_disconnect: Callable[[], None]):
    """Await ``work``; if the client disconnects first, cancel it and call ``on_disconnect``."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        on_disconnect()
        return Response(status_code=499)
    return task.result()


# --------------------------------------------------------------------------- a request's streams

def abort_all(streams: list[RequestStream]) -> None:
    """Abort every stream (finished ones ignore it)."""
    for s in streams:
        s.abort()


@contextlib.contextmanager
def admitting(streams: list[RequestStream]) -> Iterator[None]:
    """Around the ``add_request`` calls of one OpenAI request, which append to ``streams``: an
    engine's refusal aborts those already admitted and becomes the HTTP error (503 overloaded,
    the dead engine's error, 400 for a bad request)."""
    try:
        yield
    except EngineOverloadedError as e:
        abort_all(streams)
        raise overloaded(e) from None
    except EngineDeadError as e:
        abort_all(streams)
        raise engine_dead(e) from None
    except (ValueError, OverflowError) as e:
        abort_all(streams)
        raise bad_request(str(e), param_of(str(e))) from None


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (FINAL_ONLY streams yield exactly one)."""
    async def last(s: RequestStream) -> RequestOutput:
        final = None
        async for out in s:
            final = out
        assert final is not None
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ValueError as e:  # the engine refused it (429 when the SLO scheduler did)
        raise refused(e) from None
    finally:
        abort_all(streams)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
