"""End to end, offline: ``bench throughput`` on a tiny random Llama
(tests/helpers/tiny_models.py), llmkit against Hugging Face ``generate`` on the same prompts,
threads and dtype. The figure to read is the ratio (``extra_info["ratio_output_throughput"]``),
not the absolute times.

Run: ``pytest benchmarks/test_e2e_bench.py --benchmark-only -s``.
"""
from __future__ import annotations


import pytest

from helpers.tiny_models import build_model_dir, build_tokenizer

from llmkit.tools.bench.throughput import format_throughput, run_throughput  # noqa: E402
from llmkit.tools.compose import build_tool_config  # noqa: E402
from llmkit.tools.schema import BenchToolConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir("llama", tmp_path_factory.mktemp("tiny-llama"), build_tokenizer(),
                           num_hidden_layers=4, hidden_size=128, intermediate_size=256)


@pytest.mark.benchmark(group="e2e throughput")
def test_offline_throughput_vs_hf(benchmark, model_dir):
    cfg = build_tool_config(BenchToolConfig, str(model_dir), dtype="float32", overrides=[
        "bench.num_requests=48", "bench.input_len=64", "bench.output_len=32",
        "bench.range_ratio=0.5", "bench.baseline=hf", "bench.progress=false"])
    result = benchmark.pedantic(run_throughput, args=(cfg,), rounds=1, iterations=1)
    ratio = result["ratio"]["output_throughput"]
    benchmark.extra_info.update(ratio_output_throughput=ratio,
                                llmkit_tok_s=result["summary"]["output_throughput"],
                                hf_tok_s=result["baseline"]["output_throughput"])
    print("\n" + format_throughput(result))
    assert ratio > 0
