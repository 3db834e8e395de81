"""Which files of ``llmkit/`` run for one warm request: offline (``LLM.generate``) and served
(a chat completion through ``llmkit serve``, every process of the server counted).

    python benchmarks/request_path_files.py [offline|served|both] [--model PATH] [--list]

A ``sitecustomize`` put on ``PYTHONPATH`` installs a profile hook in every process (threads
included, from their start) that records the file of each Python call while recording is on.
SIGUSR1 starts recording, SIGUSR2 stops it and writes ``files-<pid>.txt``. The request is sent
after a warm-up request, so start-up and first-request work (compilation, caches) is not
counted. docs/architecture.md lists the result.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = textwrap.dedent('''
    import os, signal, sys, threading
    _DIR = os.environ.get("LLMKIT_FILE_TRACE_DIR")
    if _DIR:
        _on = [False]
        _files = set()

        def _profile(frame, event, arg):
            if _on[0] and event == "call":
                _files.add(frame.f_code.co_filename)

        def _start(*_):
            _files.clear()
            _on[0] = True

        def _stop(*_):
            _on[0] = False
            with open(os.path.join(_DIR, f"files-{os.getpid()}.txt"), "w") as f:
                f.write("\\n".join(sorted(_files)))

        sys.setprofile(_profile)
        threading.setprofile(_profile)
        signal.signal(signal.SIGUSR1, _start)
        signal.signal(signal.SIGUSR2, _stop)
''')

OFFLINE = textwrap.dedent('''
    import os, signal, sys
    from llmkit import LLM, SamplingParams
    llm = LLM(sys.argv[1])
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for _ in range(2):
        llm.generate(["The capital of France is"], params)
    os.kill(os.getpid(), signal.SIGUSR1)
    llm.generate(["The capital of France is"], params)
    os.kill(os.getpid(), signal.SIGUSR2)
''')


def _package_files(trace_dir: Path) -> dict[int, set[str]]:
    """Per process: the files under llmkit/ (repository-relative) that ran."""
    root = str(REPO / "llmkit") + os.sep
    kernels = str(REPO / "kernels") + os.sep
    out: dict[int, set[str]] = {}
    for f in trace_dir.glob("files-*.txt"):
        names = {n for n in f.read_text().splitlines() if n.startswith((root, kernels))}
        out[int(f.stem.split("-")[1])] = {str(Path(n).relative_to(REPO)) for n in names}
    return out


def _env(trace_dir: Path, site_dir: Path) -> dict[str, str]:
    env = dict(os.environ, LLMKIT_FILE_TRACE_DIR=str(trace_dir))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), env.get("PYTHONPATH")) if p)
    return env


def offline(model: str, site_dir: Path) -> dict[int, set[str]]:
    trace_dir = Path(tempfile.mkdtemp(prefix="llmkit-trace-"))
    subprocess.run([sys.executable, "-c", OFFLINE, model], env=_env(trace_dir, site_dir),
                   check=True, cwd=REPO)
    return _package_files(trace_dir)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kid = int(stat.parent.name)
            kids += [kid, *_children(kid)]
    return kids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(model: str, site_dir: Path) -> dict[int, set[str]]:
    trace_dir = Path(tempfile.mkdtemp(prefix="llmkit-trace-"))
    port = _free_port()
    cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "serve", model,
           f"server.port={port}"]
    proc = subprocess.Popen(cmd, env=_env(trace_dir, site_dir), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    body = {"model": model, "max_tokens": 16, "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(1)
        served_name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body["model"] = served_name
        for _ in range(2):
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        pids = [proc.pid, *_children(proc.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        time.sleep(0.5)
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return _package_files(trace_dir)


def _report(name: str, per_process: dict[int, set[str]], show: bool) -> dict:
    union = set().union(*per_process.values()) if per_process else set()
    print(f"{name}: {len(union)} files of llmkit/ ran for one warm request "
          f"({', '.join(str(len(v)) for v in per_process.values())} per process)")
    if show:
        for f in sorted(union):
            print(f"  {f}")
    return {"files": len(union), "per_process": [len(v) for v in per_process.values()],
            "list": sorted(union)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="both", choices=["offline", "served", "both"])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the "
                    "default model)")
    ap.add_argument("--list", action="store_true", help="print the files")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = subprocess.run([sys.executable, "-m", "llmkit.models.default_model"],
                               check=True, capture_output=True, text=True).stdout.strip()
    site_dir = Path(tempfile.mkdtemp(prefix="llmkit-site-"))
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    result = {}
    if args.mode in ("offline", "both"):
        result["offline"] = _report("offline", offline(model, site_dir), args.list)
    if args.mode in ("served", "both"):
        result["served"] = _report("served", served(model, site_dir), args.list)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
