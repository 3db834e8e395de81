"""Start-up steps that can take seconds say so: ``with startup_step("loading the weights"):``.

A step that is still running after a second logs ``<what> ...`` and, when it ends, ``<what>:
done in N s`` (logger ``llmkit.startup``, INFO); a quick step logs nothing, so a warm start stays
quiet. The server's processes log at INFO already; ``llmkit generate`` / ``chat`` show the lines
on stderr (``show_startup_progress``); in a user's process they follow the user's logging setup.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["logger", "show_startup_progress", "startup_step"]

logger = logging.getLogger("llmkit.startup")
ANNOUNCE_AFTER_S = 1.0


@contextlib.contextmanager
def startup_step(what: str, after_s: float = ANNOUNCE_AFTER_S) -> Iterator[None]:
    """Announce ``what`` if it runs longer than ``after_s``, and its duration when it ends."""
    start = time.perf_counter()
    lock = threading.Lock()
    state = {"announced": False, "finished": False}

    def announce() -> None:
        with lock:
            if not state["finished"]:
                state["announced"] = True
                logger.info("%s ...", what)

    timer = threading.Timer(after_s, announce)
    timer.daemon = True
    timer.start()
    ended = "stopped after"  # an exception (a failure, an exit) left the step
    try:
        yield
        ended = "done in"
    finally:
        timer.cancel()
        with lock:
            state["finished"] = True
            announced = state["announced"]
        if announced:
            logger.info("%s: %s %.1f s", what, ended, time.perf_counter() - start)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged, not when it was installed.

    The handler outlives the command that installed it (one process may run many commands, as
    the tests do); a stream captured at install time may be closed by then.
    """

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock (Handler.handle)
        super().emit(record)


def show_startup_progress(stream=None) -> None:
    """Print the start-up steps as ``llmkit: ...`` lines on stderr (the terminal commands)."""
    if any(getattr(h, "_llmkit_startup", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("llmkit: %(message)s"))
    handler._llmkit_startup = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
