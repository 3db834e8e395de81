"""Daemon threads that run torch code end before the interpreter does.

CPython before 3.14 ends a daemon thread still running at exit by calling ``pthread_exit`` the
next time the thread takes the GIL. Inside torch's op bindings that is in C++: each op gives
the GIL up around its call and takes it back in ``pybind11::gil_scoped_release``'s destructor,
which is noexcept, so the forced unwind of ``pthread_exit`` stops there and the C++ runtime
calls ``std::terminate``: "terminate called without an active exception", SIGABRT (exit code
134) after a program that did all it had to. A background step-graph compile (dynamo's trace
and inductor's passes run thousands of such ops) still running when a short program ended did
that.

So a thread registered here (:func:`stop_at_exit`) is stopped while the interpreter can still
run it: when the shutdown starts (``threading``'s exit hooks, before non-daemon threads are
joined and ``atexit`` runs), :class:`ExitStop` is raised in it (``PyThreadState_SetAsyncExc``).
It sees it at its next Python bytecode, within milliseconds in a trace or a code generation,
unwinds it like any exception (torch's C++ frames pass Python errors on) and ends; the exit
waits for that, at most :data:`EXIT_WAIT_S`. A thread blocked in C waiting for a child process
(the C++ compiler: most of a cold compile) or a lock (a compile pool's result) runs no bytecode
until that ends: it is left waiting at once, as it is in no C++ frame of torch's there
(``atexit`` looks once more, for a wait that ended meanwhile).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_WAIT_S", "ExitStop", "stop_at_exit", "stop_threads", "stop_threads_now"]

#: The longest an exit waits for the registered threads to end.
EXIT_WAIT_S = 5.0

# Registered threads, and those ExitStop was raised in (it is raised once: a second one could
# land in the handler of the first).
_threads: list[threading.Thread] = []
_raised: set[threading.Thread] = set()
_lock = threading.Lock()
# Where a thread blocks in C waiting for a child process or a lock: its innermost frames' files.
_BLOCKING_WAIT_FILES = frozenset({subprocess.__file__, selectors.__file__, threading.__file__})


class ExitStop(BaseException):
    """Raised in a registered thread when the interpreter shuts down. A BaseException, as
    KeyboardInterrupt is, so that the code it interrupts (dynamo, inductor) passes it on
    rather than taking it for a failure to handle."""


def stop_at_exit(thread: threading.Thread) -> None:
    """Stop ``thread`` (started or about to be) when the interpreter starts to shut down; its
    target catches :class:`ExitStop`."""
    _install()
    with _lock:
        _threads[:] = [t for t in _threads if t.ident is None or t.is_alive()]
        _threads.append(thread)
        _raised.intersection_update(_threads)


def stop_threads_now(timeout_s: float = EXIT_WAIT_S) -> None:
    """The exit hook: :func:`stop_threads` on every registered thread."""
    with _lock:
        threads = list(_threads)
    stop_threads(threads, timeout_s)


def stop_threads(threads: list[threading.Thread], timeout_s: float = EXIT_WAIT_S
                 ) -> list[threading.Thread]:
    """Raise :class:`ExitStop` in each of ``threads`` still running (once per thread) and wait
    until each has ended or blocks in a wait for a child process or a lock, at most
    ``timeout_s`` in all; the threads still running."""
    me = threading.current_thread()
    with _lock:
        threads = [t for t in threads if t.is_alive() and t is not me]
        for thread in threads:
            if thread not in _raised:
                _raised.add(thread)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(ExitStop))
    deadline = time.monotonic() + timeout_s
    waiting = threads
    while waiting and time.monotonic() < deadline:
        waiting[0].join(0.02)
        waiting = [t for t in waiting if t.is_alive() and not _blocked_in_a_wait(t)]
    return [t for t in threads if t.is_alive()]


def _blocked_in_a_wait(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    for _ in range(3):  # e.g. subprocess.run -> communicate -> selectors' select, the syscall
        if frame is None:
            return False
        if frame.f_code.co_filename in _BLOCKING_WAIT_FILES:
            return True
        frame = frame.f_back
    return False


@functools.cache
def _install() -> None:
    # concurrent.futures registers a threading exit hook that waits for its pools' queued work
    # (inductor compiles in one): imported first, its hook runs after this one (they run
    # last-registered first), once the stopped thread queues no more work.
    import concurrent.futures.thread  # noqa: F401

    # CPython-internal; where it is missing, atexit's hooks also run before finalizing
    register: Callable[..., None] = getattr(threading, "_register_atexit", atexit.register)
    with contextlib.suppress(RuntimeError):  # already shutting down: too late to stop any
        register(stop_threads_now)
        atexit.register(stop_threads_now)
