"""Answering while the engine works, and stopping when the client leaves: server-sent-event
responses that abort their requests however they end, and non-streaming work cut short by a
disconnect."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

__all__ = ["EngineStreamingResponse", "run_until_disconnect", "sse"]


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
