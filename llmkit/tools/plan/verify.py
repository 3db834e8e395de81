"""A candidate measured on the real engine: ``llmkit serve MODEL recipe=PATH`` in a child
process on a free port, then ``bench serve`` (``llmkit.tools.bench.serve.run_serve``) on the
plan's workload against it, then the server stopped. The server's output goes to a log file
beside the results.

The server is started with ``compilation.background=false`` (unless the engine overrides set
it): it answers /health only once its step graphs are in place. A candidate whose graphs are
not saved yet (another ``max_num_seqs`` or KV pool than any earlier start: the graph key holds
both) would otherwise trace them on a background thread during the measured run, its decode
steps eager and sharing the cores with the compiler, and measure a cold start rather than the
config (docs/plan.md). The simulator predicts the steady state; so is it measured."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["VerifyError", "free_port", "measure"]


class VerifyError(RuntimeError):
    """The verification server did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise VerifyError(f"the verification server exited with {proc.returncode} before "
                              f"it was up ({log_path}): {' | '.join(tail)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # the server is starting: poll its /health
    raise VerifyError(f"the verification server did not answer {url} within "
                      f"{timeout_s:.0f} s (plan.server_timeout_s; log: {log_path})")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(cfg: Any, recipe: Path, *, model: str | None, overrides: Sequence[str],
            out_dir: Path, name: str, log: Callable[[str], None],
            trace: Path | None = None) -> dict[str, Any]:
    """Serve ``recipe`` (with ``model`` and the engine ``overrides``) and run ``bench serve``
    with ``cfg``'s workload and SLO against it; returns the result document (written to
    ``out_dir/<name>.json`` with its figure). ``trace``: the server records its steps there
    (``observability.trace_file``, written when it stops)."""
    from llmkit.tools.bench.cli import graphs_before_timing
    from llmkit.tools.bench.results import write_result
    from llmkit.tools.bench.serve import run_serve

    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "serve",
           *([model] if model else []), f"recipe={recipe}", "server.host=127.0.0.1",
           f"server.port={port}", *graphs_before_timing(overrides),
           *([f"observability.trace_file={trace}"] if trace is not None else [])]
    log_path = out_dir / f"{name}-server.log"
    log(f"verify {name}: {' '.join(cmd[3:])} (log: {log_path})")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}/health",
                          cfg.plan.server_timeout_s, log_path)
            bench = cfg.bench.model_copy(update={"base_url": f"http://127.0.0.1:{port}",
                                                 "progress": False})
            result = run_serve(cfg.model_copy(update={"bench": bench}))
        finally:
            _stop(proc)
    write_result(result, out_dir, name)
    return result
