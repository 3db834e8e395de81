"""``llmkit bench latency``: the latency of one batch through the offline engine, with the time
of every engine step.

One batch of ``bench.batch_size`` requests (``bench.dataset``, ``input_len`` / ``output_len``;
a fresh seed per iteration so that no iteration hits the prefix cache of another) is generated
``bench.num_iters_warmup`` times untimed, then ``bench.num_iters`` times timed. Each engine step
is timed by a ``StepTrace`` (the step observer that ``observability.trace_file`` writes with),
registered on the engine for the run; steps are **prefill** steps when they compute any prompt
token, else **decode** steps.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from llmkit.config.errors import ConfigError
from llmkit.tools.bench.datasets import build_workload
from llmkit.tools.bench.metrics import stats

__all__ = ["format_latency", "run_latency"]


def run_latency(cfg: Any, *, sweep: Mapping[str, Any] | None = None,
                llm: Any = None) -> dict[str, Any]:
    from llmkit.engine.llm import LLM
    from llmkit.engine.observe.step_trace import StepTrace
    from llmkit.sampling.params import SamplingParams
    from llmkit.tools.bench.results import make_result

    b = cfg.bench
    if b.lora_names:
        raise ConfigError("bench.lora_names", list(b.lora_names), "", message=(
            "bench latency runs the base model only; spread requests over adapters with "
            "bench serve or bench throughput"))
    own = llm is None
    if own:
        llm = LLM.from_config(cfg.engine)
    llamacpp_dir = None
    if b.baseline == "llamacpp":  # fail before the run
        from llmkit.tools.bench.llamacpp_baseline import check_llamacpp
        llamacpp_dir = check_llamacpp(b, llm.model_source.path)
    model_path = llm.model_source.path
    import torch
    threads = torch.get_num_threads()
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    trace = StepTrace()
    engine.add_step_observer(trace)
    latencies: list[float] = []
    steps: list[dict[str, Any]] = []
    last_steps: list[dict[str, Any]] = []
    try:
        for it in range(b.num_iters_warmup + b.num_iters):
            batch_cfg = b.model_copy(update={"num_requests": b.batch_size, "seed": b.seed + it})
            workload = build_workload(batch_cfg, tokenizer)
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=b.ignore_eos,
                                     temperature=b.temperature) for r in workload]
            trace.clear()
            t0 = time.perf_counter()
            llm.generate([r.payload_prompt for r in workload], params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            if it < b.num_iters_warmup:
                continue
            latencies.append(elapsed)
            last_steps = [s.to_dict() for s in trace.steps]
            steps.extend(last_steps)
    finally:
        engine.remove_step_observer(trace)
        if own:
            llm.shutdown()
    prefill = [s["step_ms"] for s in steps if s["prefill_tokens"]]
    decode = [s["step_ms"] for s in steps if not s["prefill_tokens"] and s["decode_tokens"]]
    summary = {
        "batch_size": b.batch_size, "num_iters": b.num_iters,
        "latency_s": stats(latencies),
        "steps_per_iter": len(steps) / max(len(latencies), 1),
        "prefill_step_ms": stats(prefill), "decode_step_ms": stats(decode),
        "num_prefill_steps": len(prefill), "num_decode_steps": len(decode),
        "decode_tokens_per_s": (sum(s["decode_tokens"] for s in steps)
                                / (sum(decode) / 1e3) if decode else None),
    }
    if cfg.engine.speculative.enabled:
        drafts = sum(s["spec_drafts"] for s in steps)
        proposed = sum(s["spec_draft_tokens"] for s in steps)
        accepted = sum(s["spec_accepted_tokens"] for s in steps)
        # decode_tokens counts the verified drafts; what the requests gained is this
        summary["decode_tokens_per_s"] = (
            (sum(s["decode_tokens"] for s in steps) - proposed + accepted) / (sum(decode) / 1e3)
            if decode else None)
        summary["spec_decode"] = {
            "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}
    baseline = ratio = None
    if llamacpp_dir is not None:
        from llmkit.tools.bench.llamacpp_baseline import run_llamacpp

        baseline = run_llamacpp(llamacpp_dir, model_path, threads=threads,
                                num_seqs=b.batch_size, input_len=b.input_len,
                                output_len=b.output_len, reps=b.llamacpp_reps)
        ratio = {"decode_tokens_per_s": (summary["decode_tokens_per_s"]
                                         / baseline["decode_throughput"]
                                         if summary["decode_tokens_per_s"] else None)}
    config = {**cfg.flat_dump(mode="json", by_alias=True), "sweep": dict(sweep or {})}
    return make_result(config, summary, [{"latency_s": x, "ok": True} for x in latencies],
                       simulated=False, kind="latency", steps=last_steps,
                       baseline=baseline, ratio=ratio)


def format_latency(result: Mapping[str, Any]) -> str:
    s = result["summary"]
    lat, pf, dc = s["latency_s"], s["prefill_step_ms"], s["decode_step_ms"]

    def f(v: Any, scale: float = 1.0, unit: str = "") -> str:
        return "-" if v is None else f"{v * scale:.2f}{unit}"

    return "\n".join([
        f"llmkit bench latency: batch of {s['batch_size']}, {s['num_iters']} timed iterations, "
        f"{s['steps_per_iter']:.1f} steps each",
        f"  batch latency   mean {f(lat['mean'], 1e3, ' ms')}  p50 {f(lat['p50'], 1e3, ' ms')}  "
        f"p99 {f(lat['p99'], 1e3, ' ms')}",
        f"  prefill step    mean {f(pf['mean'], unit=' ms')}  p50 {f(pf['p50'], unit=' ms')}  "
        f"p99 {f(pf['p99'], unit=' ms')}  ({s['num_prefill_steps']} steps)",
        f"  decode step     mean {f(dc['mean'], unit=' ms')}  p50 {f(dc['p50'], unit=' ms')}  "
        f"p99 {f(dc['p99'], unit=' ms')}  ({s['num_decode_steps']} steps)",
        f"  decode tokens/s {f(s['decode_tokens_per_s'])}",
    ] + ([_spec_line(s["spec_decode"])] if s.get("spec_decode") else [])
      + _llamacpp_lines(result))


def _spec_line(spec: Mapping[str, Any]) -> str:
    return (f"  speculative     {spec['num_drafts']} drafts, {spec['num_draft_tokens']} draft "
            f"tokens, {spec['num_accepted_tokens']} accepted (rate "
            f"{100 * spec['acceptance_rate']:.1f}%, mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f})")


def _llamacpp_lines(result: Mapping[str, Any]) -> list[str]:
    base = result.get("baseline")
    if not base:
        return []
    r = (result.get("ratio") or {}).get("decode_tokens_per_s")
    return [f"  llama.cpp decode tokens/s {base['decode_throughput']:.2f}  (prompt "
            f"{base['prompt_throughput']:.1f} tok/s; {base['tool']}, {base['threads']} threads)",
            f"  ratio llmkit/llama.cpp (decode tokens/s): "
            + ("-" if r is None else f"{r:.2f}x")]
