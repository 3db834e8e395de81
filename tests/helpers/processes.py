"""Helpers for tests that start servers and engine processes."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_for(cond, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def _all_threads_stopped(pid: int) -> bool:
    try:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return bool(states) and all(s in "Tt" for s in states)


@contextlib.contextmanager
def paused(pid: int, timeout: float = 10.0) -> Iterator[None]:
    """Process ``pid`` frozen (SIGSTOP) for the block: every thread of it is stopped when the
    block starts, so it makes no progress meanwhile (it can still be SIGKILLed). Resumed
    (SIGCONT) however the block ends, unless it died in it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        if not wait_for(lambda: _all_threads_stopped(pid), timeout, interval=0.001):
            raise AssertionError(f"process {pid} did not stop within {timeout} s")
        yield
    finally:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
