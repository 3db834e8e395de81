"""Step graphs made ready without making the first start wait for them.

A cold start on the CPU compiles the decode step graphs for minutes (dynamo's trace and
inductor's C++ build); a warm start loads them from the compile cache in seconds. So the
runner loads what was saved at once, and when something is left to compile, compiles it on a
daemon thread while the engine serves every step eagerly; between two steps, on the engine
thread, the runner swaps the graphs in (:meth:`BackgroundCapture.poll`). The graphs compute
eager's bits, so a request that spans the swap gets the tokens it would have got either way.

Why this is safe beside live steps: the capture's warm-up runs write no KV (their slots are
-1) and read block 0 only, and no graph is run by the engine thread before ``poll`` hands it
over (the thread never touches one after). torch.fx's tracer patches ``torch.nn.Module``'s
``__call__`` and ``__getattr__`` for the whole process while it traces, so an eager step on
the engine thread would run through the other thread's tracer and fail: each fx trace and each
eager step take one lock while a capture runs (:meth:`BackgroundCapture.eager_step`); the
traces are short, inductor's code generation and C++ build, the long part, run beside eager
steps. A capture that fails is logged and the engine stays eager; one still running when the
program exits is stopped first (:mod:`llmkit.worker.exit_stop`: a thread left inside torch's
C++ while the interpreter finalizes aborts the process), so the exit is prompt and keeps the
program's exit code; what it had compiled is lost, the next start compiles again.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time

import torch

from llmkit.compilation.base import StepGraphs
from llmkit.startup import startup_step
from llmkit.worker.exit_stop import ExitStop, stop_at_exit

__all__ = ["BackgroundCapture", "capture_now", "compile_step_what", "prepare_step_graphs"]

logger = logging.getLogger(__name__)


def compile_step_what(graphs: StepGraphs, background: bool) -> str:
    """The progress line of a capture: what it is, what runs meanwhile, how to skip it."""
    meanwhile = "in the background; decode steps run eagerly until they are ready" \
        if background else "before serving"
    return (f"compiling the decode step graphs ({graphs.name}, 1-{graphs.max_rows} rows) "
            f"{meanwhile} (compilation.mode=eager skips this)")


def capture_now(graphs: StepGraphs, block_table_width: int) -> float:
    """Capture on this thread, saying so when it takes more than a second; the seconds."""
    with _CAPTURE_LOCK, startup_step(compile_step_what(graphs, background=False)):
        return graphs.capture(block_table_width)


_COMPILE_SWITCH_INTERVAL_S = 0.00001


def _yield_to_the_engine() -> None:
    """Lower this thread's CPU priority (Linux schedules threads as tasks; the compiler
    processes it starts inherit it): the engine's eager steps, not the compile, get the cores
    the two share."""
    # not Linux, or not allowed: the compile runs at the engine's priority
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


# One per process, as the patch it guards against is: torch.fx's tracer is a process-wide
# class, and two runners in one process (a draft model's and its target's) share it.
_FX_TRACE_LOCK = threading.RLock()
# Inductor's compile keeps process-wide state too (two at once fail an assertion in its
# bundler, leaving an engine eager): two runners' background captures in one process (a draft
# model's and its target's, two LLMs) compile one after the other.
_CAPTURE_LOCK = threading.Lock()


@functools.cache
def _serialize_fx_traces() -> None:
    """Make every torch.fx trace in this process hold ``_FX_TRACE_LOCK`` (installed once)."""
    from torch.fx._symbolic_trace import Tracer

    trace = Tracer.trace

    @functools.wraps(trace)
    def locked_trace(self, *args, **kwargs):
        with _FX_TRACE_LOCK:
            return trace(self, *args, **kwargs)

    Tracer.trace = locked_trace


class BackgroundCapture:
    """``graphs.capture(block_table_width)`` on a daemon thread; :meth:`poll` hands the graphs
    over once they are ready."""

    def __init__(self, graphs: StepGraphs, block_table_width: int) -> None:
        self.graphs = graphs
        self.block_table_width = block_table_width
        self.started_s = time.perf_counter()
        self.failed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._capture, name="llmkit-step-graphs",
                                        daemon=True)

    def start(self) -> BackgroundCapture:
        _serialize_fx_traces()
        stop_at_exit(self._thread)
        self._thread.start()
        return self

    def eager_step(self) -> contextlib.AbstractContextManager:
        """Held around an eager step while the capture runs: no fx trace (which patches
        ``torch.nn.Module`` process-wide) is in progress meanwhile."""
        return contextlib.nullcontext() if self._done.is_set() else _FX_TRACE_LOCK

    def _capture(self) -> None:
        try:
            self._compile()
        except ExitStop:  # the program is exiting (raised once, maybe past _compile's try)
            self.failed = True

    def _compile(self) -> None:
        _yield_to_the_engine()
        # The trace is Python holding the GIL; an eager step needs it thousands of times. A
        # short switch interval hands it back to the engine thread sooner while this runs.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, _COMPILE_SWITCH_INTERVAL_S))
        try:
            # inference mode is per thread: the graphs are traced as the engine runs them
            with _CAPTURE_LOCK, torch.inference_mode(), \
                    startup_step(compile_step_what(self.graphs, True)):
                self.graphs.capture(self.block_table_width)
        except ExitStop:
            self.failed = True
        except BaseException:  # noqa: BLE001 - any failure leaves the engine eager, running
            self.failed = True
            if not sys.is_finalizing():  # an exit while compiling is no failure to report
                logger.warning("step graphs (%s): compiling failed; decode steps keep running "
                               "eagerly", self.graphs.name, exc_info=True)
        finally:
            sys.setswitchinterval(interval)
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the capture has ended (tests, benchmarks); whether it has."""
        return self._done.wait(timeout)

    def poll(self) -> StepGraphs | None:
        """The graphs once the capture has succeeded, else None (still running, or failed:
        see :attr:`done` and :attr:`failed`). Called by the engine thread between steps."""
        if not self._done.is_set() or self.failed:
            return None
        logger.info("step graphs (%s) for decode steps of 1-%d rows ready after %.1f s; decode "
                    "steps use them from now on", self.graphs.name, self.graphs.max_rows,
                    time.perf_counter() - self.started_s)
        return self.graphs


def prepare_step_graphs(graphs: StepGraphs, block_table_width: int, *, background: bool,
                        compile_missing: bool
                        ) -> tuple[StepGraphs | None, BackgroundCapture | None]:
    """The runner's graphs at start-up: (graphs ready now, a capture still running). Graphs
    saved by an earlier start are loaded now (seconds); graphs to compile are compiled on a
    daemon thread when ``background``, not at all when not ``compile_missing``, else now, with
    a progress line either way. (Graphs that capture in seconds, CUDA's, are captured now.)"""
    if graphs.capture_in_background and (background or not compile_missing):
        with startup_step(f"loading the saved decode step graphs ({graphs.name}; "
                          "compilation.mode=eager skips them)"):
            loaded = graphs.load_saved(block_table_width)
        if loaded:
            logger.info("step graphs (%s) for decode steps of 1-%d rows loaded",
                        graphs.name, graphs.max_rows)
            return graphs, None
        if not compile_missing:
            logger.info("step graphs (%s): none saved for this model and set-up, and "
                        "compilation.compile_missing=false: decode steps run eagerly "
                        "(llmkit chat or serve compile them once, for every later start)",
                        graphs.name)
            return None, None
        return None, BackgroundCapture(graphs, block_table_width).start()
    seconds = capture_now(graphs, block_table_width)
    logger.info("step graphs (%s) for decode steps of 1-%d rows ready in %.1f s",
                graphs.name, graphs.max_rows, seconds)
    return graphs, None
