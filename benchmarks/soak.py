"""A soak of llmkit's server: fuzzing, load with misbehaving clients, and a killed engine.

    python benchmarks/soak.py                       # a tiny random model, ~3 minutes
    python benchmarks/soak.py --model smollm2-135m-instruct --duration 300 --clients 64

Everything runs on 127.0.0.1 against a server this script starts, and stops by itself: the
load phase ends after ``--duration`` seconds or ``--max-requests`` requests, whichever comes
first, and every request has a timeout. Phases, each with its figures:

1. **fuzz** (``--fuzz-examples`` per operation and mode; ``server_fuzz.py``): requests generated
   from ``/openapi.json`` for every operation — count, 5xx answers, answers not in OpenAI's
   error shape or not as the schema declares.
2. **load**: ``--clients`` concurrent clients, each sending request after request: streams read
   to the end, streams read slowly, streams the client drops after a few chunks (disconnect),
   plain requests the client gives up on (abort), plain requests; completions and chat.
   Every request that the client did not drop must finish, and its text must equal the
   offline engine's greedy output for the same prompt (``LLM`` in this process, same model):
   ``lost`` counts those that failed or hung, ``mismatched`` those with another text. Meanwhile
   ``/health`` is polled (latency percentiles, failures) and the resident memory of the API
   and engine processes sampled: ``rss_growth_pct`` is the largest RSS after warm-up (the first
   ``--warmup`` fraction of the phase) over the RSS at the end of warm-up. At the end, with
   nothing in flight, ``/v1/engine/stats?check_kv=true``: ``leaked_blocks`` (blocks still held)
   and the KV cache's integrity verdict.
3. **kill**: ``--kill-streams`` long streams run, the engine core process is killed (SIGKILL):
   time until ``/health`` answers 503, how the streams ended (an error event each; none may
   hang), then (``server.restart_engine=true``) time until ``/health`` is 200 again and a
   request that must equal the offline output.

Exit code 0 when every check holds (see ``check()``), 1 otherwise; ``--json PATH`` writes the
figures. ``tests/test_server_soak.py`` runs a short version.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server_health import wait_healthy  # benchmarks/: run as a script, its folder is on the path

REPO = Path(__file__).resolve().parents[1]
API_KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT_WORDS = ("The river flows through the city and the bridges are old and beautiful. "
                "People ask questions about the weather, about history and travel. Once upon a "
                "time there was a little robot who lived in a quiet town near the sea.").split()


# --------------------------------------------------------------------------- the server

class Server:
    """``llmkit serve MODEL`` on a free loopback port, with the soak's settings."""

    def __init__(self, model: str, overrides: list[str], log_path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "serve", model,
               "server.host=127.0.0.1", f"server.port={self.port}",
               f"server.api_key={API_KEY}", "server.restart_engine=true", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_healthy(self.proc, self.base_url, lambda: self.log()[-3000:], timeout)

    def engine_pid(self) -> int:
        stats = httpx.get(self.base_url + "/v1/engine/stats", headers=AUTH, timeout=10).json()
        return int(stats["engine"]["pid"])

    def stop(self) -> None:
        engine = self._live_engine_pid()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # Never leave the engine core behind; a pid is only killed while it is still that
        # engine (a multiprocessing child of the server, or its orphan), never a reused one.
        if engine is not None and _is_spawn_child(engine):
            try:
                os.kill(engine, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()

    def _live_engine_pid(self) -> int | None:
        try:
            pid = self.engine_pid()
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pid if ppid == self.proc.pid else None


def _is_spawn_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing" in f.read()
    except OSError:
        return False


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


# --------------------------------------------------------------------------- the workload

@dataclass(frozen=True)
class Job:
    """One request of the pool: what is sent and what the offline engine answered."""

    kind: str  # "completion" | "chat"
    prompt: str
    max_tokens: int
    expected: str


def make_jobs(model: str, num: int, seed: int, overrides: list[str]) -> list[Job]:
    """``num`` prompts with their offline greedy answers (``LLM`` in this process)."""
    from llmkit import LLM, SamplingParams

    rng = random.Random(seed)
    specs = []
    for i in range(num):
        start = rng.randrange(len(PROMPT_WORDS) - 12)
        prompt = " ".join(PROMPT_WORDS[start:start + rng.randint(3, 12)])
        specs.append(("chat" if i % 4 == 3 else "completion", prompt,
                      rng.choice((8, 16, 32, 64))))
    llm = LLM(model, dtype="float32", overrides=overrides)
    jobs = []
    for kind, prompt, m in specs:
        params = SamplingParams(temperature=0.0, max_tokens=m)
        if kind == "chat":
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        else:
            out = llm.generate([prompt], params, use_tqdm=False)
        jobs.append(Job(kind, prompt, m, out[0].outputs[0].text))
    llm.shutdown()
    return jobs


def request_of(job: Job, stream: bool, **extra) -> tuple[str, dict]:
    body: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": 0, "stream": stream,
                            **extra}
    if job.kind == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = job.prompt
    return "/v1/completions", body


def piece_of(chunk: dict) -> str:
    choice = chunk["choices"][0] if chunk.get("choices") else None
    if choice is None:
        return ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def read_stream(resp: httpx.Response, slow_s: float = 0.0,
                      stop_after: int | None = None) -> tuple[str, str | None, int]:
    """(text, error message or None, chunks read); ``stop_after`` chunks then hang up."""
    text, error, chunks = [], None, 0
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]["message"]
            continue
        text.append(piece_of(chunk))
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
        if slow_s:
            await asyncio.sleep(slow_s)
    return "".join(text), error, chunks


@dataclass
class LoadResult:
    completed: int = 0  # finished and checked against the offline output
    mismatched: int = 0
    lost: int = 0  # should have finished but failed, errored or timed out
    disconnected: int = 0  # the client hung up on purpose
    aborted: int = 0  # the client gave up on purpose before the answer
    by_behaviour: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)  # a few failures, for the report

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


BEHAVIOURS = (("stream", 0.35), ("slow_stream", 0.15), ("disconnect", 0.15),
              ("abort", 0.10), ("plain", 0.25))


async def one_request(http: httpx.AsyncClient, job: Job, behaviour: str, rng: random.Random,
                      result: LoadResult, timeout_s: float) -> None:
    result.by_behaviour[behaviour] = result.by_behaviour.get(behaviour, 0) + 1
    stream = behaviour in ("stream", "slow_stream", "disconnect")
    path, body = request_of(job, stream)
    try:
        if stream:
            async with asyncio.timeout(timeout_s):
                async with http.stream("POST", path, json=body, headers=AUTH) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    if behaviour == "disconnect":
                        await read_stream(resp, stop_after=rng.randint(1, 4))
                        result.disconnected += 1
                        return
                    text, error, _ = await read_stream(
                        resp, slow_s=rng.uniform(0.005, 0.03) if behaviour == "slow_stream"
                        else 0.0)
            if error is not None:
                raise RuntimeError(f"error event: {error}")
        elif behaviour == "abort":
            try:
                async with asyncio.timeout(rng.uniform(0.005, 0.15)):
                    resp = await http.post(path, json=body, headers=AUTH)
            except TimeoutError:
                result.aborted += 1
                return
            text = _plain_text(resp)
        else:
            async with asyncio.timeout(timeout_s):
                resp = await http.post(path, json=body, headers=AUTH)
            text = _plain_text(resp)
    except Exception as e:  # noqa: BLE001 - counted and reported
        result.lost += 1
        result.note(f"{behaviour} {job.kind}: {type(e).__name__}: {e}")
        return
    if text == job.expected:
        result.completed += 1
    else:
        result.mismatched += 1
        result.note(f"{behaviour} {job.kind} {job.prompt!r}: got {text[:60]!r}, expected "
                    f"{job.expected[:60]!r}")


def _plain_text(resp: httpx.Response) -> str:
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def load_phase(server: Server, jobs: list[Job], *, clients: int, duration_s: float,
                     max_requests: int, warmup: float, seed: int,
                     timeout_s: float = 120.0) -> dict[str, Any]:
    result = LoadResult()
    rng = random.Random(seed)
    start = time.monotonic()
    deadline = start + duration_s
    budget = [max_requests]
    engine_pid = server.engine_pid()
    health_ms: list[float] = []
    health_failures: list[str] = []
    rss: list[tuple[float, int, int]] = []  # (seconds since start, API RSS, engine RSS)
    done = asyncio.Event()
    names = [b for b, _ in BEHAVIOURS]
    weights = [w for _, w in BEHAVIOURS]

    async def client(i: int) -> None:
        crng = random.Random(seed * 1000 + i)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout_s,
                                     limits=limits) as http:
            while time.monotonic() < deadline and budget[0] > 0:
                budget[0] -= 1
                await one_request(http, crng.choice(jobs),
                                  crng.choices(names, weights)[0], crng, result, timeout_s)

    async def watch_health() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            while not done.is_set():
                t = time.perf_counter()
                try:
                    r = await http.get("/health")
                    if r.status_code != 200:
                        health_failures.append(f"{r.status_code}")
                except httpx.HTTPError as e:
                    health_failures.append(type(e).__name__)
                health_ms.append(1e3 * (time.perf_counter() - t))
                await asyncio.sleep(0.2)

    async def watch_memory() -> None:
        while not done.is_set():
            a, b = rss_bytes(server.proc.pid), rss_bytes(engine_pid)
            if a is not None and b is not None:
                rss.append((time.monotonic() - start, a, b))
            await asyncio.sleep(0.5)

    watchers = [asyncio.ensure_future(watch_health()), asyncio.ensure_future(watch_memory())]
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        done.set()
        await asyncio.gather(*watchers)
    elapsed = time.monotonic() - start
    # Nothing is in flight: every block must be back.
    idle = await wait_idle(server)
    memory = rss_figures(rss, warmup * elapsed)
    requests = sum(result.by_behaviour.values())
    return {
        "clients": clients, "duration_s": round(elapsed, 1), "requests": requests,
        "requests_per_s": round(requests / elapsed, 1) if elapsed else 0.0,
        "completed": result.completed, "mismatched": result.mismatched, "lost": result.lost,
        "disconnected": result.disconnected, "aborted": result.aborted,
        "by_behaviour": result.by_behaviour, "failure_examples": result.examples,
        "health_checks": len(health_ms), "health_failures": len(health_failures),
        "health_ms": _percentiles(health_ms),
        **memory,
        "leaked_blocks": idle["num_held_blocks"], "kv_integrity_error": idle["kv_error"],
        "idle_after_s": idle["waited_s"],
    }


def rss_figures(rss: list[tuple[float, int, int]], warm_at: float) -> dict[str, Any]:
    """RSS at the end of warm-up and its largest value after, for the API process, the engine
    process and both; growth in percent of the warm-up value."""
    out: dict[str, Any] = {}
    for name, pick in (("api", lambda r: r[1]), ("engine", lambda r: r[2]),
                       ("total", lambda r: r[1] + r[2])):
        warm = [pick(r) for r in rss if r[0] <= warm_at]
        after = [pick(r) for r in rss if r[0] > warm_at]
        base = warm[-1] if warm else (pick(rss[0]) if rss else 0)
        peak = max(after) if after else base
        out[f"rss_mib_{name}"] = [round(base / 2 ** 20, 1), round(peak / 2 ** 20, 1)]
        out[f"rss_growth_pct_{name}" if name != "total" else "rss_growth_pct"] = \
            round(100.0 * (peak - base) / base, 2) if base else 0.0
    out["rss_samples"] = [(round(t, 1), round(a / 2 ** 20), round(b / 2 ** 20))
                          for t, a, b in rss[::max(1, len(rss) // 12)]]
    return out


async def wait_idle(server: Server, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until nothing runs or waits, then check the KV cache (fresh, with integrity)."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=15) as http:
        while True:
            latest = (await http.get("/v1/engine/stats", params={"check_kv": "true"},
                                     headers=AUTH)).json()["latest"]
            idle = latest["num_running"] == 0 and latest["num_waiting"] == 0
            if idle or time.monotonic() - start > timeout_s:
                return {"num_held_blocks": latest["num_held_blocks"],
                        "kv_error": latest["kv_integrity_error"], "idle": idle,
                        "waited_s": round(time.monotonic() - start, 2)}
            await asyncio.sleep(0.1)


def _percentiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return {"p50": round(q[49], 2), "p99": round(q[98], 2), "max": round(max(xs), 2)}


# --------------------------------------------------------------------------- the kill

async def kill_phase(server: Server, jobs: list[Job], *, streams: int, max_model_len: int,
                     restart_timeout_s: float = 300.0) -> dict[str, Any]:
    """Long streams in flight, SIGKILL to the engine core: /health 503, error events, no hang;
    then the restarted core serves the offline output again."""
    engine_pid = server.engine_pid()
    long_tokens = max(16, max_model_len - 64)
    started = asyncio.Event()
    first_chunks = [0]
    outcomes: list[str] = []

    async def long_stream(i: int) -> None:
        body = {"prompt": jobs[i % len(jobs)].prompt, "max_tokens": long_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                async with asyncio.timeout(60):
                    async with http.stream("POST", "/v1/completions", json=body,
                                           headers=AUTH) as resp:
                        error, n, chunk = None, 0, {}
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line[6:] == "[DONE]":
                                break
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                error = chunk["error"]
                            else:
                                n += 1
                                if n == 1:
                                    first_chunks[0] += 1
                                    if first_chunks[0] == streams:
                                        started.set()
                finished = chunk.get("choices", [{}])[0].get("finish_reason") \
                    if error is None else None
                outcomes.append("error_event" if error is not None and
                                error.get("code") == "engine_dead" else
                                f"finished:{finished}" if finished else "ended_without_error")
        except TimeoutError:
            outcomes.append("hung")
        except httpx.HTTPError as e:
            outcomes.append(f"transport:{type(e).__name__}")

    tasks = [asyncio.ensure_future(long_stream(i)) for i in range(streams)]
    try:
        await asyncio.wait_for(started.wait(), 60)
    except TimeoutError:
        pass
    killed = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    to_503 = None
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as http:
        while time.monotonic() - killed < 10:
            try:
                if (await http.get("/health")).status_code == 503:
                    to_503 = time.monotonic() - killed
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        streams_ended = time.monotonic() - killed
        back = None
        while time.monotonic() - killed < restart_timeout_s:
            try:
                if (await http.get("/health")).status_code == 200:
                    back = time.monotonic() - killed
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        served_again = None
        if back is not None:
            job = jobs[0]
            path, body = request_of(job, stream=False)
            r = await http.post(path, json=body, headers=AUTH, timeout=60)
            served_again = r.status_code == 200 and _plain_text(r) == job.expected
    idle = await wait_idle(server) if back is not None else {"num_held_blocks": None,
                                                             "kv_error": None}
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return {"streams": streams, "health_503_after_s": _round(to_503),
            "streams_ended_after_s": round(streams_ended, 2), "stream_outcomes": counts,
            "restarted_after_s": _round(back), "served_again_correctly": served_again,
            "leaked_blocks_after_restart": idle["num_held_blocks"],
            "kv_integrity_error_after_restart": idle["kv_error"]}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --------------------------------------------------------------------------- all of it

def run_soak(model: str, *, clients: int = 64, duration_s: float = 120.0,
             max_requests: int = 100_000, fuzz_examples: int = 60, kill_streams: int = 16,
             warmup: float = 0.25, num_jobs: int = 32, num_blocks: int = 1024,
             max_model_len: int = 512, seed: int = 0, threads: int = 1,
             engine_overrides: list[str] = (), log_dir: Path | None = None) -> dict[str, Any]:
    """Every phase; the figures as a dict (``check()`` lists what failed).
    ``engine_overrides`` (``key=value``) apply to the server and the offline reference."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="llmkit-soak-"))
    engine = [f"kv_cache.num_blocks={num_blocks}", f"platform.num_threads={threads}",
              f"model.max_model_len={max_model_len}", *engine_overrides]
    server = Server(model, ["model.dtype=float32", "server.max_waiting_requests=4096", *engine],
                    log_dir / "server.log")
    figures: dict[str, Any] = {"model": model, "engine_overrides": engine,
                               "log": str(log_dir / "server.log")}
    try:
        jobs = make_jobs(model, num_jobs, seed, engine)  # while the server starts
        server.wait_ready()
        if fuzz_examples:
            from server_fuzz import fuzz_server

            report = fuzz_server(server.base_url, API_KEY, fuzz_examples, seed=seed)
            figures["fuzz"] = {**report.summary(), "failure_examples": report.failures[:10]}
        figures["load"] = asyncio.run(load_phase(server, jobs, clients=clients,
                                                 duration_s=duration_s,
                                                 max_requests=max_requests, warmup=warmup,
                                                 seed=seed))
        if kill_streams:
            figures["kill"] = asyncio.run(kill_phase(server, jobs, streams=kill_streams,
                                                     max_model_len=max_model_len))
    finally:
        server.stop()
    figures["server_exit_code"] = server.proc.returncode
    return figures


def check(figures: dict[str, Any], rss_limit_pct: float = 10.0) -> list[str]:
    """What the figures fail of this soak's bar (empty: all good)."""
    bad = []
    fuzz = figures.get("fuzz")
    if fuzz is not None and (fuzz["server_errors"] or fuzz["failures"]):
        bad.append(f"fuzz: {fuzz['server_errors']} 5xx, {fuzz['failures']} failures")
    load = figures["load"]
    for key in ("lost", "mismatched", "health_failures", "leaked_blocks"):
        if load[key]:
            bad.append(f"load: {key}={load[key]}")
    if load["kv_integrity_error"]:
        bad.append(f"load: KV integrity: {load['kv_integrity_error']}")
    if load["completed"] == 0:
        bad.append("load: nothing completed")
    if load["rss_growth_pct"] > rss_limit_pct:
        bad.append(f"load: RSS grew {load['rss_growth_pct']}% after warm-up")
    kill = figures.get("kill")
    if kill is not None:
        if kill["health_503_after_s"] is None or kill["health_503_after_s"] > 5:
            bad.append(f"kill: /health 503 after {kill['health_503_after_s']} s")
        if set(kill["stream_outcomes"]) != {"error_event"}:
            bad.append(f"kill: stream outcomes {kill['stream_outcomes']}")
        if not kill["served_again_correctly"]:
            bad.append(f"kill: not served again (restart after {kill['restarted_after_s']} s)")
        if kill["leaked_blocks_after_restart"] or kill["kv_integrity_error_after_restart"]:
            bad.append("kill: KV blocks held or inconsistent after the restart")
    if figures.get("server_exit_code") not in (0, None):
        bad.append(f"server exited with {figures['server_exit_code']}")
    return bad


def tiny_model(out: Path) -> str:
    """The test suite's tiny random Llama (weights x3: robust greedy), saved under ``out``."""
    from helpers.tiny_models import build_model_dir, build_tokenizer

    return str(build_model_dir("llama", out, build_tokenizer()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="preset, HF folder or .gguf (default: a "
                    "tiny random model built here)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120.0, help="load phase, seconds")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--fuzz-examples", type=int, default=60,
                    help="per operation and mode (0 = no fuzz phase)")
    ap.add_argument("--kill-streams", type=int, default=16, help="0 = no kill phase")
    ap.add_argument("--warmup", type=float, default=0.25)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="engine compute threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-override", action="append", default=[], metavar="KEY=VALUE",
                    help="for the server and the offline reference, e.g. "
                         "platform.packed_linear=false (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmkit-soak-model-") as tmp:
        model = args.model or tiny_model(Path(tmp) / "tiny-llama")
        figures = run_soak(model, clients=args.clients, duration_s=args.duration,
                           max_requests=args.max_requests, fuzz_examples=args.fuzz_examples,
                           kill_streams=args.kill_streams, warmup=args.warmup,
                           num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                           threads=args.threads, seed=args.seed,
                           engine_overrides=args.engine_override)
    problems = check(figures)
    figures["problems"] = problems
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    print("soak: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)),
          file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
