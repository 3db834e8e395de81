"""``server.restart_engine=true``: when the engine core process dies, start a new one.

Requests in flight when it died have failed already (500, or an error event on a stream) and
``/health`` answers 503 until the new core is ready; then the server serves again. A core that
fails to start is retried after 1, 2, 4 ... (at most 60) seconds.
"""
from __future__ import annotations

import asyncio
import logging

from llmkit.engine.async_llm import AsyncLLM

__all__ = ["keep_engine_running"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
MAX_BACKOFF_S = 60.0


async def keep_engine_running(engine: AsyncLLM) -> None:
    """Run until cancelled (the server's lifespan cancels it at shutdown)."""
    backoff = 1.0
    while True:
        await asyncio.sleep(POLL_S)
        if not engine.errored or not engine.engine_core.dead_error:
            continue
        logger.warning("the engine core died (%s); starting a new one",
                       engine.engine_core.dead_error)
        try:
            await engine.restart_engine_core()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried after a back-off
            logger.error("the new engine core failed to start: %s; retrying in %.0f s", e,
                         backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            continue
        backoff = 1.0
        logger.info("engine core restarted (pid %s); serving again",
                    engine.engine_core.ready.pid if engine.engine_core.ready else "?")
