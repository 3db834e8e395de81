"""The engine's decode speed alone and beside a fixed background load, per OpenMP wait policy.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp), whose threads spin
(``GOMP_SPINCOUNT``, 300,000 iterations by default) before they sleep at the end of each region.
A decode step of a small model is ~300 short regions; when another process takes a core, the
spinning threads hold theirs while the thread they wait for is descheduled, and the step can
take 10-25x as long. This benchmark measures that, and what each policy costs on a quiet
machine:

- ``default``: libgomp's own (spin 300k, then sleep)
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once: a wake-up per region)
- ``spin1k`` / ``spin10k`` / ``spin100k``: ``GOMP_SPINCOUNT=1000`` / ``10000`` / ``100000``
- ``active``: ``OMP_WAIT_POLICY=ACTIVE`` (spin for ever, the worst case under load)
- ``spin1k_openmp`` / ``spin10k_openmp``: as ``spin1k`` / ``spin10k``, and llmkit's C++
  kernels on torch's OpenMP threads (``platform.dispatch.thread_pool_spin_us=0``) instead of
  their own pool

Each policy runs in its own process (libgomp reads these when torch loads), which loads the
model once and then alternates quiet and loaded phases (the load: ``--load busy`` = one
busy-loop process, ``--load omp`` = a second torch process with its own OpenMP threads doing
matmuls). The policies are interleaved over ``--rounds`` rounds; medians and the spread over
all phases are printed, with each policy's loaded / quiet ratio.

    python benchmarks/cpu_contention_bench.py [--rounds 2] [--load busy|omp] [--dtype bfloat16]

On a machine others are using, "quiet" is only as quiet as they leave it: compare policies
within one run, and re-run on an idle machine for absolute figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
POLICIES.update({f"{name}_openmp": POLICIES[name] for name in ("spin1k", "spin10k")})
# Policies whose C++ kernels run on torch's OpenMP threads instead of their own pool (which
# spins yielding its core, then sleeps: platform.dispatch.thread_pool_spin_us).
OPENMP_KERNELS = {name for name in POLICIES if name.endswith("_openmp")}
_OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _busy_loop(parent: int) -> None:
    while os.getppid() == parent:  # ends with the measuring process, however it ends
        for _ in range(100_000):
            pass


def _omp_job(parent: int) -> None:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    a = torch.randn(256, 256)
    while os.getppid() == parent:
        for _ in range(50):
            a = torch.tanh(a @ a * 1e-2)


def _start_load(kind: str):
    target = _busy_loop if kind == "busy" else _omp_job
    proc = multiprocessing.get_context("spawn").Process(target=target, args=(os.getpid(),),
                                                        daemon=True)
    proc.start()
    time.sleep(0.5 if kind == "busy" else 3.0)  # the omp job imports torch first
    return proc


def _decode_tps(llm, rows: int, tokens: int) -> float:
    from llmkit import SamplingParams

    prompts = [[100 + 7 * i + j for j in range(32)] for i in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - start)


def child(args) -> None:
    from llmkit import LLM

    # compilation.background=false: time the step graphs, not eager steps beside their compile
    platform = {"num_threads": args.threads}
    if args.openmp_kernels:
        platform["dispatch"] = {"thread_pool_spin_us": 0}
    llm = LLM(dtype=args.dtype, kv_cache={"num_blocks": 256},
              scheduler={"max_num_seqs": max(args.rows)}, platform=platform,
              compilation={"background": False})
    _decode_tps(llm, 1, 8)  # warm-up
    out: dict[str, list[float]] = {}
    for phase in range(args.phases):
        for loaded in (False, True):
            load = _start_load(args.load) if loaded else None
            try:
                for rows in args.rows:
                    key = f"{'loaded' if loaded else 'quiet'} rows={rows}"
                    out.setdefault(key, []).append(_decode_tps(llm, rows, args.tokens))
            finally:
                if load is not None:
                    load.kill()
                    load.join()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phases", type=int, default=2, help="quiet/loaded pairs per process")
    ap.add_argument("--policies", default="spin1k_openmp,spin1k,spin10k_openmp")
    ap.add_argument("--load", choices=("busy", "omp"), default="busy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--openmp-kernels", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, dict[str, list[float]]] = {}
    names = args.policies.split(",")
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else list(reversed(names))):
            # LLM in this process: llmkit sets no OpenMP variables; the policy is all there is
            env = {k: v for k, v in os.environ.items() if k not in _OMP_VARS}
            env.update(POLICIES[name])
            cmd = [sys.executable, __file__, "--child", f"--phases={args.phases}",
                   f"--load={args.load}", f"--dtype={args.dtype}",
                   f"--rows={','.join(map(str, args.rows))}", f"--tokens={args.tokens}",
                   f"--threads={args.threads}"]
            if name in OPENMP_KERNELS:
                cmd.append("--openmp-kernels")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            for key, xs in json.loads(line[0][7:]).items():
                results.setdefault(name, {}).setdefault(key, []).extend(xs)
            print(f"round {r} {name}: done", file=sys.stderr, flush=True)
    print(f"decode tok/s, dtype {args.dtype}, load {args.load!r}, {os.cpu_count()} cores "
          f"(median [min..max] over {args.rounds * args.phases} phases)")
    for name, by_key in results.items():
        cells = []
        for rows in args.rows:
            q, lo = by_key.get(f"quiet rows={rows}", []), by_key.get(f"loaded rows={rows}", [])
            if not q or not lo:
                continue
            ratio = statistics.median(lo) / statistics.median(q)
            cells.append(f"rows={rows}: quiet {statistics.median(q):6.1f} "
                         f"[{min(q):.1f}..{max(q):.1f}]  loaded {statistics.median(lo):6.1f} "
                         f"[{min(lo):.1f}..{max(lo):.1f}]  loaded/quiet {ratio:.2f}")
        print(f"{name:>9}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
