"""Decode requests' TPOT with a long-prompt stream mixed in: colocated (one engine computes
both) vs disaggregated (a prefill engine and a decode engine through the shared-memory
connector and ``llmkit proxy``), on the default model, every engine on one thread.

The interference the seed describes (ch. 12): in one engine a long prefill shares steps with
the decoding requests, so their time per output token grows; split, the decode engine only
loads the long prompts' KV. Note the split setup uses two cores to the colocated one's one.

Each setup, alternated (colocated, disaggregated, disaggregated, colocated, ...): ``--decoders``
clients stream short requests back to back while one client sends long prompts back to back;
a decode request's TPOT = (last chunk - first chunk) / (chunks - 1). Prints medians and the
spread (p10-p90) of the decode requests' TPOT, and the long requests' TTFT, per setup.

    python benchmarks/disagg_tpot.py [--seconds 20] [--rounds 1] [--long 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from llmkit.executor.multiproc import free_port
from llmkit.tools.bench.metrics import percentile
from server_health import wait_healthy  # benchmarks/: run as a script, its folder is on the path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact").split()


class Proc:
    def __init__(self, args: list[str], log: Path, port: int) -> None:
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self._f = open(log, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", "llmkit.entrypoints.cli", *args],
                                  cwd=REPO, stdout=self._f, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 300) -> None:
        wait_healthy(self.p, self.url, lambda: f"{self.log}:\n{self.log.read_text()[-3000:]}",
                     timeout, interval=0.5)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self._f.close()


def _serve(tmp: Path, name: str, *overrides: str) -> Proc:
    port = free_port()
    return Proc(["serve", f"server.port={port}", "platform.num_threads=1", *overrides],
                tmp / f"{name}.log", port)


def _stream(url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times of the completion's text chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _run(url: str, seconds: float, decoders: int, long_words: int, decode_tokens: int,
         seed: int) -> tuple[list[float], list[float]]:
    """Decode requests' TPOTs and the long requests' TTFTs over ``seconds``."""
    stop = time.monotonic() + seconds
    tpots: list[float] = []
    ttfts: list[float] = []
    lock = threading.Lock()

    def decoder(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        while time.monotonic() < stop:
            t = _stream(url, _words(rng, 24), decode_tokens)
            if len(t) > 1:
                with lock:
                    tpots.append((t[-1] - t[0]) / (len(t) - 1))

    def long_stream() -> None:
        rng = random.Random(seed * 100 + 99)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            t = _stream(url, _words(rng, long_words), 4)
            if t:
                with lock:
                    ttfts.append(t[0] - t0)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(decoders)]
    threads.append(threading.Thread(target=long_stream))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return tpots, ttfts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0, help="per setup and round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--long", type=int, default=1000, help="words in a long prompt")
    ap.add_argument("--decode-tokens", type=int, default=32)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="llmkit-disagg-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="llmkit-kv-", dir="/dev/shm"
                                if os.path.isdir("/dev/shm") else None))
    kv = ("kv_transfer=shared_memory", f"kv_transfer.shm_dir={shm}")
    procs = {
        "colocated": _serve(tmp, "colocated"),
        "prefill": _serve(tmp, "prefill", *kv, "kv_transfer.kv_role=kv_producer",
                          "kv_transfer.engine_id=bench-prefill"),
        "decode": _serve(tmp, "decode", *kv, "kv_transfer.kv_role=kv_consumer",
                         "kv_transfer.engine_id=bench-decode"),
    }
    proxy = None
    try:
        for p in procs.values():
            p.wait()
        port = free_port()
        proxy = Proc(["proxy", f"proxy.prefill_urls=[{procs['prefill'].url}]",
                      f"proxy.decode_urls=[{procs['decode'].url}]", f"proxy.port={port}"],
                     tmp / "proxy.log", port)
        proxy.wait()
        urls = {"colocated": procs["colocated"].url, "disaggregated": proxy.url}
        for url in urls.values():  # warm up
            _stream(url, _words(random.Random(1), 200), 4)
        results: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in urls}
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                tp, tt = _run(urls[name], args.seconds, args.decoders, args.long,
                              args.decode_tokens, seed=r)
                results[name][0].extend(tp)
                results[name][1].extend(tt)
        print(f"decode TPOT with a {args.long}-word prompt stream mixed in ({args.decoders} "
              f"decode clients, {args.decode_tokens} tokens each, {args.rounds} x "
              f"{args.seconds:.0f} s per setup; every engine 1 thread):")
        base = statistics.median(results["colocated"][0]) if results["colocated"][0] else None
        for name, (tp, tt) in results.items():
            if not tp:
                print(f"  {name:14s} no decode request finished")
                continue
            med = statistics.median(tp)
            ratio = f"  x{med / base:.2f} of colocated" if base else ""
            long_ttft = (f"  long-prompt TTFT median {statistics.median(tt) * 1e3:.0f} ms "
                         f"({len(tt)} requests)") if tt else ""
            print(f"  {name:14s} TPOT median {med * 1e3:7.1f} ms (p10 {percentile(tp, 10) * 1e3:.1f}, "
                  f"p90 {percentile(tp, 90) * 1e3:.1f}; {len(tp)} requests){ratio}{long_ttft}")
        # The split really moved KV: the decode engine's tokens loaded from the prefill one.
        metrics = httpx.get(procs["decode"].url + "/metrics", timeout=10).text
        remote = [line for line in metrics.splitlines()
                  if line.startswith("llmkit:kv_connector_hit_tokens") and "remote" in line]
        print("  decode engine:", remote[0] if remote else "no remote KV hits (!)")
    finally:
        if proxy is not None:
            proxy.stop()
        for p in procs.values():
            p.stop()


if __name__ == "__main__":
    main()
