"""llmkit.worker.exit_stop: a thread running Python (and torch ops) ends within milliseconds of
ExitStop; one waiting for a child process is left at once, and ends with ExitStop when the
child does. (The exit itself, SIGABRT without it, is tested in test_step_graphs_background.)"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch

from llmkit.worker.exit_stop import ExitStop, stop_threads


def start(target) -> tuple[threading.Thread, dict]:
    seen = {"started": threading.Event()}

    def run():
        seen["started"].set()
        try:
            target()
        except ExitStop:
            seen["stopped"] = True

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert seen["started"].wait(10)
    return thread, seen


def test_a_thread_running_torch_ops_ends_at_once():
    x = torch.ones(1 << 16)

    def ops():
        while True:
            x.cumsum(0)

    thread, seen = start(ops)
    t0 = time.monotonic()
    assert stop_threads([thread], timeout_s=10) == []
    assert time.monotonic() - t0 < 2 and seen.get("stopped")


def test_a_thread_waiting_for_a_child_process_is_left_at_once_and_stops_after():
    thread, seen = start(lambda: subprocess.run([sys.executable, "-c",
                                                 "import time; time.sleep(2)"]))
    time.sleep(0.3)  # inside the wait
    t0 = time.monotonic()
    assert stop_threads([thread], timeout_s=10) == [thread]
    assert time.monotonic() - t0 < 1
    thread.join(20)
    assert not thread.is_alive() and seen.get("stopped")
