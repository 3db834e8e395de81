"""The quantized linear of every instruction-set tier this CPU supports, side by side.

Each tier's C++ library (``platform.isa``; ``llmkit/config/cpu_isa.py``) runs ``quant_linear``
on the same packed weights (SmolLM2-135M's shapes), tiers alternated within each round, the
median per-call time over the rounds printed with each tier's speed-up over the first one
(``--tiers`` picks some, e.g. ``avx512_bf16,amx`` at ``--rows 16,64,256,1024`` for the amx
tier's tiles against the VNNI kernel). The tiers
compute the same bits (tests/test_quant_kernels.py); this measures what each one is worth here.

    python benchmarks/cpu_isa_bench.py [--rounds 7] [--calls 50] [--threads 2] [--tiers a,b]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmkit.config.cpu_isa import cpu_model, supported_tiers
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.quant import weights

from helpers.gguf_rows import random_gguf_rows

SHAPES = [("q4_1", 576, 1536), ("q4_1", 1536, 576), ("q8_0", 576, 49152)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--tiers", type=lambda s: s.split(","), default=None,
                    help="comma-separated tiers (default: every supported one), the first the base")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tiers = args.tiers or list(supported_tiers())
    ops = {t: load_cpu_kernels(t) for t in tiers}
    print(f"{cpu_model()}; tiers {', '.join(tiers)}; {args.threads} threads")
    for fmt, k, n in SHAPES:
        packed = weights.pack_gguf(random_gguf_rows(fmt, n, k, seed=0), fmt, k)
        for rows in args.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {t: [] for t in tiers}
            for _ in range(args.rounds):
                for t in tiers:
                    op = ops[t].quant_linear
                    for _ in range(3):
                        op(x, packed.data, fmt, n, None)
                    t0 = time.perf_counter()
                    calls = max(1, args.calls * 8 // max(rows, 8))  # fewer calls for prefill rows
                    for _ in range(calls):
                        op(x, packed.data, fmt, n, None)
                    times[t].append((time.perf_counter() - t0) / calls * 1e6)
            base = statistics.median(times[tiers[0]])
            cells = [f"{t} {statistics.median(v):7.1f} us ({base / statistics.median(v):.2f}x, "
                     f"{min(v):.1f}..{max(v):.1f})" for t, v in times.items()]
            print(f"{fmt} {k}->{n} rows={rows}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
