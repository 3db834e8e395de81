"""The batched LoRA ops on SmolLM2-135M's layer shapes: torch groups vs the C++ ``lora_add_``
at each row count, with the base layer's own GEMM (the CPU linear method) as the yardstick.

Four rank-16 adapters, rows assigned round robin (the worst case for grouping: no two adjacent
rows share an adapter). Each (path, rows) is timed alternately with the others, repeatedly;
the median per call is printed with the spread, and the LoRA time as a fraction of the base
layer's. The CPU dispatch table's ``lora_small_batch_max_rows`` is set from these crossovers. Run:
``pytest benchmarks/test_lora_ops_bench.py --benchmark-only -s`` (or ``python`` this file).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.lora.base import RowSlots
from llmkit.lora.punica import CpuLoRAOps, StackedLoRA, TorchLoRAOps

# (name, in, output sizes): qkv_proj, o_proj, gate_up_proj, down_proj of SmolLM2-135M
LAYERS = (("qkv", 576, (576, 192, 192)), ("o", 576, (576,)), ("gate_up", 576, (1536, 1536)),
          ("down", 1536, (576,)))
ROWS = (1, 4, 8, 32, 128, 512, 2048)
SLOTS, RANK = 4, 16


def _stack(inp: int, outs: tuple[int, ...]) -> StackedLoRA:
    g = torch.Generator().manual_seed(0)
    w = StackedLoRA.empty(SLOTS, RANK, inp, outs, torch.float32)
    w.a.copy_(torch.randn(w.a.shape, generator=g) * 0.02)
    w.b.copy_(torch.randn(w.b.shape, generator=g) * 0.02)
    for s in range(SLOTS):
        w.set_ranks(s, [RANK] * len(outs))
    return w


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def run(rounds: int = 5, reps: int = 5) -> list[dict]:
    from llmkit.kernels.cpu_native import load_cpu_kernels
    from llmkit.linear.cpu_linear import CpuLinearMethod
    from llmkit.models.layers.linear import MergedLinear

    kernels = load_cpu_kernels()
    torch_ops, cpu_ops = TorchLoRAOps(), CpuLoRAOps(kernels)
    cpu_ops.small_batch_max_rows = 1 << 30
    results = []
    for name, inp, outs in LAYERS:
        w = _stack(inp, outs)
        layer = MergedLinear(name, inp, {i: o for i, o in enumerate(outs)}, bias=False,
                             dtype=torch.float32,
                             linear_method=lambda spec: CpuLinearMethod(kernels))
        layer.weight.data.normal_()
        layer.process_weights_after_loading()
        for rows in ROWS:
            x = torch.randn(rows, inp)
            y = torch.zeros(rows, sum(outs))
            slots = RowSlots(np.arange(rows, dtype=np.int32) % SLOTS, torch.device("cpu"))
            _ = slots.segments, slots.sorted_rows, slots.tensor
            arms = {"base": lambda: layer(x),
                    "torch": lambda: torch_ops.add_lora(y, x, w, slots),
                    "c++": lambda: cpu_ops.add_lora(y, x, w, slots)}
            times = {k: [] for k in arms}
            with torch.inference_mode():
                for fn in arms.values():
                    fn()
                for _ in range(rounds):
                    for k, fn in arms.items():
                        times[k].append(_time(fn, reps))
            med = {k: statistics.median(v) for k, v in times.items()}
            results.append({"layer": name, "rows": rows, "median_us": {k: v * 1e6 for k, v in
                                                                       med.items()},
                            "spread_us": {k: (min(v) * 1e6, max(v) * 1e6)
                                          for k, v in times.items()}})
    return results


def format_results(results: list[dict]) -> str:
    lines = [f"{'layer':8s} {'rows':>5s} {'base us':>9s} {'torch us':>9s} {'c++ us':>9s} "
             f"{'torch/base':>10s} {'c++/base':>9s}  (median of rounds; spread min-max, us)"]
    for r in results:
        m, sp = r["median_us"], r["spread_us"]
        lines.append(f"{r['layer']:8s} {r['rows']:5d} {m['base']:9.1f} {m['torch']:9.1f} "
                     f"{m['c++']:9.1f} {m['torch'] / m['base']:10.2f} {m['c++'] / m['base']:9.2f}"
                     f"  torch {sp['torch'][0]:.0f}-{sp['torch'][1]:.0f}, c++ "
                     f"{sp['c++'][0]:.0f}-{sp['c++'][1]:.0f}")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.benchmark(group="multi-lora")
def test_lora_ops_crossover(benchmark):
    results = benchmark.pedantic(run, rounds=1, iterations=1)
    print("\n" + format_results(results))
    # the C++ kernel must pay where it is used: up to the table's rows it is not slower
    # than the torch groups (the median over layers and row counts of the per-case medians)
    limit = CpuDispatch().lora_small_batch_max_rows
    ratios = [r["median_us"]["c++"] / r["median_us"]["torch"] for r in results
              if r["rows"] <= limit]
    assert statistics.median(ratios) <= 1.0, format_results(results)


if __name__ == "__main__":
    print(format_results(run()))
