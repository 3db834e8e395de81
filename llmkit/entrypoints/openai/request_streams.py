"""The engine requests of one OpenAI request (one per prompt) as a group: admitted all or none
(``admitting``), their final outputs (``collect``), their outputs as they come (``merge``), or
all aborted (``abort_all``)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Iterator

from llmkit.engine.async_llm import EngineDeadError, EngineOverloadedError, RequestStream
from llmkit.entrypoints.openai.errors import bad_request, engine_dead, overloaded, param_of
from llmkit.outputs import RequestOutput

__all__ = ["abort_all", "admitting", "collect", "merge"]


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
    except ValueError as e:
        raise bad_request(str(e)) from None
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
