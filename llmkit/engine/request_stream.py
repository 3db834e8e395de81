"""``RequestStream``: the outputs of one ``AsyncLLM`` request as an async iterator."""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from llmkit.outputs import RequestOutput

__all__ = ["RequestStream"]


class StreamOwner(Protocol):
    """Who follows the stream's engine requests (``RequestTracker``); the stream only asks it
    to abort them."""

    def abort_local(self, request_ids: list[str]) -> None: ...


class RequestStream:
    """The outputs of one request (all its ``n`` samples merged by the output processor:
    ``outputs[i].index`` is the sample), as an async iterator.

    Ends after the output with ``finished=True``; raises ``EngineDeadError`` if the engine
    dies, ``ValueError`` if the engine refused the request. ``abort()`` (sync, idempotent)
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
