"""CPU speed against Hugging Face ``generate`` on the default model (SmolLM2-135M-Instruct),
measured in the same run, same prompts, dtype and threads (issue "Speed on the CPU").

Workloads (greedy, ``ignore_eos``, random token-id prompts):
  A: 64 prompts x 128 tokens -> 128 new tokens (HF batches all 64)
  B: 1 prompt of 128 tokens -> 128 new tokens
  C: 128 prompts of 32-1024 tokens, 16-512 new tokens (HF: length-sorted batches of 32)

Each test asserts a floor on llmkit's output-throughput ratio over HF. The issue's targets (A
>= 2.9x, B >= 2.2x) were set on a 2-core Sapphire Rapids with AMX-bf16, in bfloat16; on a CPU
without native bf16 ``model.dtype=auto`` is float32 and HF runs the same float32 GEMMs, so the
floors asserted there are the levels measured on this project's 2-core AVX2 EPYC (see the
README's "Speed on the CPU"), with a margin for noise. Slow (minutes): run explicitly with
``pytest benchmarks/test_cpu_speed_bench.py --benchmark-only -s``; ``-k A`` picks one.
"""
from __future__ import annotations

import pytest

from llmkit.platforms.cpu import has_native_bf16
from llmkit.tools.bench.throughput import format_throughput, run_throughput
from llmkit.tools.compose import build_tool_config
from llmkit.tools.schema import BenchToolConfig

WORKLOADS = {
    "A": ["bench.num_requests=64", "bench.hf_batch_size=64", "bench.input_len=128",
          "bench.output_len=128"],
    "B": ["bench.num_requests=1", "bench.input_len=128", "bench.output_len=128"],
    "C": ["bench.num_requests=128", "bench.hf_batch_size=32", "bench.input_len=528",
          "bench.output_len=264", "bench.range_ratio=0.94"],
}
# (native bf16 CPU: the targets, float32 elsewhere: measured level minus a margin).
# B in float32 measured 1.8-2.1x with the C++ CPU kernels, 1.05-1.2x without: its floor of 1.5
# also catches a silent fall back to torch ops.
FLOORS = {"A": (2.9, 1.3), "B": (2.2, 1.5), "C": (None, 1.3)}


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.benchmark(group="cpu speed vs hf")
def test_cpu_speed_vs_hf(benchmark, name):
    cfg = build_tool_config(BenchToolConfig, None, overrides=[
        *WORKLOADS[name], "bench.baseline=hf", "bench.progress=false", "bench.ignore_eos=true"])
    result = benchmark.pedantic(run_throughput, args=(cfg,), rounds=1, iterations=1)
    ratio = result["ratio"]["output_throughput"]
    benchmark.extra_info.update(workload=name, ratio_output_throughput=ratio,
                                llmkit_tok_s=result["summary"]["output_throughput"],
                                hf_tok_s=result["baseline"]["output_throughput"],
                                dtype=result["summary"]["dtype"])
    print(f"\nworkload {name}\n" + format_throughput(result))
    native, fallback = FLOORS[name]
    floor = native if has_native_bf16() and native is not None else fallback
    assert ratio >= floor, f"workload {name}: {ratio:.2f}x HF, floor {floor}x"
