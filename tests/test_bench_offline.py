"""Offline benchmarks on a tiny model: ``bench throughput baseline=hf`` (llmkit vs transformers
``generate`` on the same prompts), ``bench latency`` (per-step timing), and the engine's
Chrome-trace step stats (``observability.trace_file``). Only counts and ratios' presence are
checked, never absolute times."""
from __future__ import annotations

import json

import pytest

from llmkit import LLM, SamplingParams
from llmkit.engine.observe.step_trace import StepTrace
from llmkit.entrypoints import cli
from llmkit.tools.bench.hf_baseline import load_hf_model, make_batches, run_hf_generate


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def test_bench_throughput_with_hf_baseline(model, tmp_path, capsys):
    rc = cli.main(["bench", "throughput", model, "baseline=hf", "model.dtype=float32",
                   "bench.num_requests=6", "bench.input_len=12", "bench.output_len=6",
                   "bench.range_ratio=0.5", "bench.hf_batch_size=4", "bench.progress=false",
                   f"bench.output_dir={tmp_path}", "bench.result_name=tp"])
    assert rc == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert "llmkit" in lines and "hf" in lines and "ratio llmkit/hf (output tok/s)" in lines
    assert "output tok/s" in lines["llmkit"] and "output tok/s" in lines["hf"]
    doc = json.loads((tmp_path / "tp.json").read_text())
    s, base = doc["summary"], doc["baseline"]
    assert doc["kind"] == "throughput" and doc["simulated"] is False
    assert s["num_requests"] == base["num_requests"] == 6
    # the same prompts, and the same output tokens counted (each prompt's own max_tokens)
    assert base["prompt_tokens"] == s["total_input_tokens"]
    assert base["output_tokens"] == s["total_output_tokens"] == sum(
        r["max_tokens"] for r in doc["requests"])
    # batches of <= 4 sorted by length: 2 batches; each ran to its longest max_tokens
    assert base["num_batches"] == 2 and base["generated_tokens"] >= base["output_tokens"]
    assert base["dtype"] == "torch.float32" and base["num_threads"] == s["num_threads"]
    assert base["attn_implementation"] == "sdpa"
    assert doc["ratio"]["output_throughput"] == pytest.approx(
        s["output_throughput"] / base["output_throughput"])
    assert f"{doc['ratio']['output_throughput']:.2f}x" in out


def test_hf_baseline_batches_and_counts(model):
    import torch

    assert make_batches([5, 1, 3, 3, 9], 2) == [[1, 2], [3, 0], [4]]
    hf = load_hf_model(model, torch.float32)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    res = run_hf_generate(hf, prompts, [3, 5, 2], pad_token_id=0, eos_token_ids=[2],
                          ignore_eos=True, batch_size=2, warmup=False)
    # each prompt counts only its own max_tokens; the batch of 2 ran to 5 new tokens each
    assert res.output_tokens == 10 and res.num_batches == 2
    assert res.generated_tokens == 2 * 5 + 1 * 2
    assert res.prompt_tokens == 9


def test_bench_latency_per_step(model, tmp_path, capsys):
    rc = cli.main(["bench", "latency", model, "model.dtype=float32", "bench.batch_size=3",
                   "bench.input_len=10", "bench.output_len=5", "bench.num_iters=2",
                   "bench.num_iters_warmup=1", f"bench.output_dir={tmp_path}",
                   "bench.result_name=lat"])
    assert rc == 0
    assert "decode step" in capsys.readouterr().out
    doc = json.loads((tmp_path / "lat.json").read_text())
    s = doc["summary"]
    assert doc["kind"] == "latency" and s["num_iters"] == 2 and len(doc["requests"]) == 2
    steps = doc["steps"]  # the last iteration's steps
    assert sum(st["prefill_tokens"] for st in steps) == 3 * 10
    # each request's first token comes from its prefill step; the other 4 from decode steps
    assert sum(st["decode_tokens"] for st in steps) == 3 * 4
    assert s["num_decode_steps"] == 2 * 4 and s["decode_step_ms"]["p50"] is not None


def test_step_trace_file(model, tmp_path):
    trace_path = tmp_path / "trace.json"
    llm = LLM(model, dtype="float32", scheduler={"max_num_batched_tokens": 16},
              kv_cache={"enable_prefix_caching": False},
              overrides=[f"observability.trace_file={trace_path}"])
    prompts = [[5 + i] * n for i, n in enumerate((3, 7, 40))]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    (trace,) = [o for o in llm.engine.step_observers if isinstance(o, StepTrace)]
    steps = list(trace.steps)
    assert sum(s.prefill_tokens for s in steps) == 50
    assert sum(s.decode_tokens for s in steps) == 3 * 3
    assert all(s.scheduled_tokens == s.prefill_tokens + s.decode_tokens <= 16 for s in steps)
    assert all(s.num_reqs == s.prefill_reqs + s.decode_reqs for s in steps)
    # chunked prefill under a 16-token budget: the 40-token prompt spans several steps, in
    # which the two short requests already decode
    assert steps[0].prefill_tokens == 16 and steps[0].prefill_reqs == 3
    assert (steps[1].prefill_reqs, steps[1].decode_reqs) == (1, 2)
    assert (steps[1].prefill_tokens, steps[1].decode_tokens) == (14, 2)
    # context after the step: step 0 computed 3 + 7 + 6 prompt tokens; in step 1 the long
    # prompt reaches 6 + 14, the short ones 3 + 1 and 7 + 1
    assert (steps[0].prefill_context, steps[0].decode_context) == (16, 0)
    assert (steps[1].prefill_context, steps[1].decode_context) == (20, 12)
    llm.shutdown()
    doc = json.loads(trace_path.read_text())
    events = doc["traceEvents"]
    step_events = [e for e in events if e.get("cat") == "step"]
    assert len(step_events) == len(steps) and doc["otherData"]["steps"] == len(steps)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in step_events)
    assert {e["name"] for e in events if e["ph"] == "C"} == {
        "scheduled tokens", "batch size", "queue", "kv usage"}
    first = step_events[0]["args"]
    assert {"scheduled_tokens", "num_reqs", "prefill_tokens", "decode_tokens",
            "prefill_context", "decode_context", "step_ms"} <= set(first)


def test_no_trace_by_default(model):
    llm = LLM(model, dtype="float32")
    assert not llm.engine.step_observers
    llm.shutdown()


@pytest.mark.parametrize("sub,given,want", [
    ("latency", [], "compilation.background=false"),
    ("throughput", ["bench.num_requests=2"], "compilation.background=false"),
    ("latency", ["compilation.background=true"], "compilation.background=true"),
    ("serve", [], None)])
def test_offline_benches_wait_for_step_graphs(sub, given, want):
    """bench latency/throughput time the engine users run: on a cold compile cache the step
    graphs compile before the timed steps (not beside them), unless the user says otherwise."""
    from types import SimpleNamespace

    from llmkit.tools.bench.cli import run_bench

    seen = []

    class Stop(Exception):
        pass

    def load_config(args, overrides, tool):
        seen.append(list(overrides))
        raise Stop

    with pytest.raises(Stop):
        run_bench(SimpleNamespace(subcommand=sub, overrides=given, multirun=False), load_config)
    background = [o for o in seen[0] if o.startswith("compilation.background=")]
    assert background == ([want] if want else [])
