"""Waiting for a server process the benchmarks started to answer ``/health`` (soak, disagg)."""
from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(proc: subprocess.Popen, base_url: str, log_tail: Callable[[], str],
                 timeout: float = 300.0, interval: float = 0.25) -> None:
    """Return once ``base_url/health`` answers 200; raise with the log's tail if the process
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(interval)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{log_tail()}")
