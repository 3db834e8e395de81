"""The dispatch table's speed-only fields on this machine: what the calibration picks, and what
each candidate is worth against the tier's default.

Runs the start-up calibration (``llmkit.kernels.cpu_calibration.calibrate``, real timer)
``--calibrations`` times and prints each choice (how stable it is here), then times every
candidate of each field on two decode-shaped workloads -- one row through 16 layers of a
576-wide model's Q4_1 weights (the default model's format) and through the same layers in
bf16 -- candidates alternated within each round (reversed every other round); per round each
candidate's time is divided by the default's, and the median ratio is printed with its
quartiles over the rounds (< 1: faster than the default). The other field stays at its
default. Every candidate computes the same bits (tests/test_cpu_calibration.py).

    GOMP_SPINCOUNT=1000 python benchmarks/cpu_calibration_bench.py [--rounds 21]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from llmkit.config.cpu_dispatch import CALIBRATED, CpuDispatch
from llmkit.config.cpu_isa import best_tier, cpu_model
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.cpu_calibration import CANDIDATES, _Workload, calibrate

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 16


def _bf16_step(ops, gen):
    ws = [torch.randn(o, k, generator=gen).mul_(0.05).to(torch.bfloat16)
          for _ in range(LAYERS) for o, k in SHAPES]
    xs = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
    return lambda: [ops.linear(xs[w.shape[1]], w, None) for w in ws]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calibrations", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_cpu_kernels(best_tier())
    defaults = CpuDispatch()
    print(f"{cpu_model()}; tier {best_tier()}; {torch.get_num_threads()} threads")
    for i in range(args.calibrations):
        t0 = time.perf_counter()
        choice, _ = calibrate(ops, defaults)
        print(f"calibration {i + 1}: {choice} in {time.perf_counter() - t0:.1f} s")
    q4 = _Workload(ops)
    x = q4.x
    steps = {"q4_1": lambda: [ops.quant_linear(x[k], p, "q4_1", o, None, None, False, False)
                              for p, o, k in q4.q4],
             "bf16": _bf16_step(ops, torch.Generator().manual_seed(0))}
    for name in CALIBRATED:
        cands = CANDIDATES[name]
        default = getattr(defaults, name)
        for what, step in steps.items():
            ratios: dict[int, list[float]] = {c: [] for c in cands}
            for r in range(args.rounds):
                took = {}
                for c in cands if r % 2 == 0 else cands[::-1]:
                    tuning = {n: getattr(defaults, n) for n in CALIBRATED} | {name: c}
                    ops.set_linear_tuning(tuning["linear_prefetch_bytes"],
                                          tuning["linear_thread_min_bytes"])
                    step()  # warm
                    t0 = time.perf_counter()
                    step()
                    took[c] = time.perf_counter() - t0
                for c in cands:
                    ratios[c].append(took[c] / took[default])
            cells = []
            for c in cands:
                q1, q3 = np.percentile(ratios[c], [25, 75])
                cells.append(f"{c}: {statistics.median(ratios[c]):.3f} [{q1:.3f}-{q3:.3f}]")
            print(f"{name} on {what} (time / default {default}'s; median [quartiles] of "
                  f"{args.rounds} rounds): " + ", ".join(cells))
    ops.set_linear_tuning(defaults.linear_prefetch_bytes, defaults.linear_thread_min_bytes)


if __name__ == "__main__":
    main()
