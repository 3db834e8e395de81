"""``llmkit serve`` in a subprocess for the server tests: started on a free port with
float32 weights, ready when /health answers 200, stopped with SIGTERM (and its engine core
process killed if it outlived it) however the test ends."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.processes import free_port, pid_alive

REPO = Path(__file__).resolve().parents[2]

# On a small shared box, one compute thread per process: the server's engine and this process's
# offline reference LLM would otherwise spin OpenMP threads against each other.
SERVER_THREADS = "platform.num_threads=1"
# the prompt most server tests send
PROMPT = "The quick brown fox jumps over the"


class ServerProcess:
    """``python -m llmkit.entrypoints.cli serve MODEL overrides...`` on a free port, started at
    once; ``with ServerProcess(...) as server:`` waits until /health answers and stops it
    after (or call ``wait_ready()`` and ``stop()`` to do other work while it starts)."""

    def __init__(self, model_dir: Path, *overrides: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "serve", str(model_dir),
               "model.dtype=float32", f"server.port={self.port}", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._engine_pid: int | None = None

    def __enter__(self) -> ServerProcess:
        """Ready to serve (the process is stopped if it never gets there)."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                # loopback: a proxy from the environment never applies
                if httpx.get(self.url("/health"), timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def engine_pid(self) -> int:
        if self._engine_pid is None:
            m = re.search(r"engine core process pid=(\d+)", self.log())
            assert m, self.log()[-2000:]
            self._engine_pid = int(m.group(1))
        return self._engine_pid

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0,
                             timeout=60, **kw)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0,
                                  timeout=60)

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` → value, plus ``name`` → value for unlabelled-model series."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = key.split("{", 1)[0]
            if "model_name" in key and key.count("=") == 1:
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._engine_pid is not None or "engine core process pid=" in self.log():
            pid = self.engine_pid
            if pid_alive(pid):  # never leave one behind, even when a test failed
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def error_body(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]
