"""Goodput under an SLO: the default config vs ``scheduler=slo`` (and its admission modes, and a
recipe ``llmkit plan`` wrote), each served by ``llmkit serve`` and loaded by ``llmkit bench
serve`` with the same workload (issue 34's load: 48 requests, Poisson arrivals at 1 req/s, 256
tokens in / 128 out, ignore_eos; SLO TTFT <= 1.5 s, TPOT <= 80 ms).

For each config (one server each, started in turn, alone on the machine) and each rate, prints
goodput, SLO attainment per objective (TTFT, TPOT, E2EL, all), p99 TTFT and mean TPOT; writes
every ``bench serve`` result into ``--out`` with the config and the rate as its sweep, so that
``llmkit bench plot OUT`` draws goodput and attainment against the rate, one line per config
(the script runs it at the end: ``OUT/sweep.png``).

    python benchmarks/slo_goodput.py [MODEL] [--rates 1] [--configs default,slo,slo-defer]
        [--recipe plan_results/recipe.yaml] [--out slo_goodput_results]
    python benchmarks/slo_goodput.py --rates 0.5,1,2,4      # the issue's rate sweep

A quick check that it runs (a tiny load; the figures mean nothing):

    python benchmarks/slo_goodput.py --num-requests 4 --rates 4 --input-len 32 --output-len 8
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from llmkit.executor.multiproc import free_port
from server_health import wait_healthy  # benchmarks/: run as a script, its folder is on the path

REPO = Path(__file__).resolve().parents[1]


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
    return out


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmkit.entrypoints.cli", *args]


def serve(model: list[str], overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    f = open(log, "wb")
    p = subprocess.Popen(_cli("serve", *model, "server.host=127.0.0.1", f"server.port={port}",
                              *overrides), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_healthy(p, url, lambda: log.read_text()[-3000:], timeout=900, interval=0.5)
    return p, url


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def bench(model: list[str], url: str, rate: float, args: argparse.Namespace, slo: list[str],
          out: Path, name: str) -> dict:
    """One ``llmkit bench serve`` run; its result document (``out/name.json``)."""
    subprocess.run(_cli(
        "bench", "serve", *model, f"bench.base_url={url}", f"bench.rate={rate}",
        f"bench.num_requests={args.num_requests}", f"bench.input_len={args.input_len}",
        f"bench.output_len={args.output_len}", "bench.ignore_eos=true", "bench.arrival=poisson",
        f"bench.seed={args.seed}", f"bench.output_dir={out}", f"bench.result_name={name}",
        "bench.progress=false", *slo), cwd=REPO, check=True)
    return json.loads((out / f"{name}.json").read_text())


def row(name: str, rate: float, summary: dict) -> str:
    att = summary.get("slo_attainment_by_metric") or {}

    def pct(k: str) -> str:
        v = att.get(k)
        return "-" if v is None else f"{100 * v:.0f}%"

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
                    "(with --recipe)")
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
    model = [args.model] if args.model else []
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="slo-goodput-"))
    lines = [f"{'config':<12} {'rate':>5} {'goodput':>8} {'TTFT':>6} {'TPOT':>6} {'E2EL':>6} "
             f"{'all':>6} {'p99 TTFT':>9} {'mean TPOT':>9} done",
             f"{'':<12} {'req/s':>5} {'req/s':>8} {'(SLO attainment, % of requests)':>27} "
             f"{'ms':>9} {'ms':>9}"]
    for name in names:
        print(f"== {name}: llmkit serve {' '.join(model + table[name] + args.serve_override)}",
              flush=True)
        proc, url = serve(model, table[name] + args.serve_override, logs / f"{name}.log")
        try:
            for rate in rates:
                point = f"{name}_rate{rate:g}"
                doc = bench(model, url, rate, args, slo, out, point)
                # the config and the rate as the result's sweep: bench plot draws one line each
                doc["config"]["sweep"] = {"bench.rate": rate, "config": name}
                (out / f"{point}.json").write_text(json.dumps(doc, indent=1, default=str))
                lines.append(row(name, rate, doc["summary"]))
                print(lines[-1], flush=True)
        finally:
            stop(proc)
    print("\n".join(["", f"SLO: TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms; "
                     f"{args.num_requests} requests, {args.input_len} in / {args.output_len} "
                     f"out, Poisson arrivals; server logs in {logs}", *lines]))
    plot = subprocess.run(_cli("bench", "plot", str(out)), cwd=REPO)
    return plot.returncode


if __name__ == "__main__":
    sys.exit(main())
