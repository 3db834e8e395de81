"""``llmkit bench throughput``: offline throughput of the ``LLM`` API (no server), optionally
against the Hugging Face ``generate`` baseline on the same model, prompts and lengths.

All requests of the workload (``bench.dataset`` etc.; arrival times are ignored) go to one
``LLM.generate`` call after an untimed warm-up request; with ``bench.lora_names`` each runs
with its ``lora.modules`` adapter. Throughputs count completed requests
and their generated tokens over the wall time of that call. With ``bench.baseline=hf`` (or the
shorthand ``baseline=hf``) the same prompt token ids run through ``transformers`` afterwards in
the same process and thread count; ``ratio`` is llmkit's throughput over the baseline's (ratios,
not absolute times, are what the suite compares). ``bench.baseline=llamacpp`` runs llama.cpp's
benchmarks on the same GGUF instead (``llmkit/tools/bench/llamacpp_baseline.py``).
"""
from __future__ import annotations

import gc
import time
from typing import Any, Mapping

from llmkit.tools.bench.datasets import build_workload

__all__ = ["format_spec_decode", "format_throughput", "run_throughput",
           "spec_decode_summary"]


def spec_decode_summary(before: Any, after: Any) -> dict[str, Any]:
    """Speculative decoding over a run: the difference of two ``SpecDecodeStats`` snapshots,
    with API.md's rates."""
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position)
                    else 0) for i, a in enumerate(after.accepted_per_position)]
    return {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def format_spec_decode(spec: Mapping[str, Any]) -> str:
    return (f"  speculative: {spec['num_drafts']} drafts, {spec['num_draft_tokens']} draft "
            f"tokens, {spec['num_accepted_tokens']} accepted (rate "
            f"{100 * spec['acceptance_rate']:.1f}%, mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}; per position "
            f"{spec['accepted_per_position']})")


def _engine_facts(llm: Any) -> dict[str, Any]:
    import dataclasses

    import torch

    info = llm.engine.backend_info
    return {"dtype": getattr(torch, info.dtype), "num_threads": torch.get_num_threads(),
            "device": torch.device(info.device), "backend": dataclasses.asdict(info)}


def _lora_requests(llm: Any, workload: list) -> list:
    """Each request's adapter (``bench.lora_names``: names of ``lora.modules`` adapters)."""
    from llmkit.tools.bench.datasets import WorkloadError

    names = {r.lora_name for r in workload} - {None}
    if not names:
        return [None] * len(workload)
    if not llm.config.lora.enabled:
        raise WorkloadError("bench.lora_names needs lora.enabled=true and the adapters in "
                            "lora.modules")
    loaded = {lr.lora_name: lr for lr in llm.list_loras()}
    missing = sorted(names - set(loaded))
    if missing:
        raise WorkloadError(f"bench.lora_names: {', '.join(missing)} not in lora.modules "
                            f"(loaded: {', '.join(sorted(loaded)) or 'none'})")
    return [loaded[r.lora_name] if r.lora_name else None for r in workload]


def run_throughput(cfg: Any, *, sweep: Mapping[str, Any] | None = None,
                   llm: Any = None) -> dict[str, Any]:
    """Run the benchmark for ``cfg`` (a ``BenchToolConfig``); returns the result document."""
    from llmkit.engine.llm import LLM
    from llmkit.sampling.params import SamplingParams
    from llmkit.tools.bench.results import make_result

    b = cfg.bench
    if b.lora_names and b.baseline == "hf":
        from llmkit.tools.bench.datasets import WorkloadError
        raise WorkloadError("bench.baseline=hf runs the base model without adapters; it cannot "
                            "be compared with bench.lora_names")
    own = llm is None
    if own:
        llm = LLM.from_config(cfg.engine)
    if b.baseline == "llamacpp":  # fail before the run
        from llmkit.tools.bench.llamacpp_baseline import check_llamacpp
        llamacpp_dir = check_llamacpp(b, llm.model_source.path)
    tokenizer = llm.get_tokenizer()
    workload = build_workload(b, tokenizer)
    prompts = [r.payload_prompt for r in workload]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=b.ignore_eos,
                             temperature=b.temperature, seed=b.seed if b.temperature else None)
              for r in workload]
    loras = _lora_requests(llm, workload)
    facts = _engine_facts(llm)
    llm.generate(prompts[0], SamplingParams(max_tokens=min(4, workload[0].max_tokens),
                                            ignore_eos=True), use_tqdm=False,
                 lora_request=loras[0])
    spec_before = llm.engine.stats().spec_decode
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=b.progress, lora_request=loras)
    elapsed = time.perf_counter() - t0
    spec = spec_decode_summary(spec_before, llm.engine.stats().spec_decode)
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    records = [{"prompt_tokens": len(o.prompt_token_ids),
                "output_tokens": sum(len(c.token_ids) for c in o.outputs),
                "max_tokens": r.max_tokens, "ok": True} for o, r in zip(outs, workload)]
    in_tok = sum(r["prompt_tokens"] for r in records)
    out_tok = sum(r["output_tokens"] for r in records)
    summary = {"num_requests": len(records), "completed": len(records), "failed": 0,
               "duration_s": elapsed, "request_throughput": len(records) / elapsed,
               "output_throughput": out_tok / elapsed,
               "total_token_throughput": (in_tok + out_tok) / elapsed,
               "total_input_tokens": in_tok, "total_output_tokens": out_tok,
               "dtype": str(facts["dtype"]), "num_threads": facts["num_threads"],
               "device": str(facts["device"]), "backend": facts["backend"]}
    if cfg.engine.speculative.enabled:
        summary["spec_decode"] = spec
    baseline = ratio = None
    if b.baseline == "hf":
        model_path = llm.model_source.path
        eos_ids = list(llm.model_source.eos_token_ids)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = eos_ids[0] if eos_ids else 0
        if own:  # free the engine's KV cache and weights before loading the baseline
            llm.shutdown()
            llm = None
            gc.collect()
        from llmkit.tools.bench.hf_baseline import load_hf_model, run_hf_generate

        model = load_hf_model(model_path, facts["dtype"], device=facts["device"])
        hf = run_hf_generate(model, prompt_ids, [r.max_tokens for r in workload],
                             pad_token_id=pad, eos_token_ids=eos_ids, ignore_eos=b.ignore_eos,
                             temperature=b.temperature, batch_size=b.hf_batch_size,
                             num_threads=facts["num_threads"], progress=b.progress)
        del model
        gc.collect()
        baseline = {"name": "hf", **hf.to_dict()}
        ratio = {k: summary[k] / baseline[k] if baseline[k] else None
                 for k in ("output_throughput", "request_throughput")}
    elif b.baseline == "llamacpp":
        from llmkit.tools.bench.llamacpp_baseline import run_llamacpp

        model_path = llm.model_source.path
        if own:
            llm.shutdown()
            llm = None
            gc.collect()
        baseline = run_llamacpp(llamacpp_dir, model_path, threads=facts["num_threads"],
                                num_seqs=len(workload), input_len=b.input_len,
                                output_len=b.output_len, reps=b.llamacpp_reps)
        ratio = {k: summary[k] / baseline[k] if baseline[k] else None
                 for k in ("output_throughput", "request_throughput")}
    if own and llm is not None:
        llm.shutdown()
    config = {**cfg.flat_dump(mode="json", by_alias=True), "sweep": dict(sweep or {})}
    return make_result(config, summary, records, simulated=False, kind="throughput",
                       baseline=baseline, ratio=ratio)


def format_throughput(result: Mapping[str, Any]) -> str:
    s = result["summary"]
    lines = [f"llmkit bench throughput: {s['num_requests']} requests, "
             f"{s['total_input_tokens']} prompt + {s['total_output_tokens']} output tokens "
             f"(dtype {s['dtype']}, {s['num_threads']} threads, {s.get('device', 'cpu')})",
             f"  llmkit: {s['duration_s']:8.2f} s  {s['request_throughput']:9.2f} req/s  "
             f"{s['output_throughput']:10.1f} output tok/s"]
    if s.get("spec_decode"):
        lines.append(format_spec_decode(s["spec_decode"]))
    base = result.get("baseline")
    if base and base.get("name") == "llamacpp":
        lines.append(f"  llama.cpp: {base['elapsed_s']:8.2f} s  {base['request_throughput']:9.2f} "
                     f"req/s  {base['output_throughput']:10.1f} output tok/s  (decode alone "
                     f"{base['decode_throughput']:.1f} tok/s, prompt {base['prompt_throughput']:.1f}"
                     f" tok/s; {base['tool']}, {base['threads']} threads)")
        r = result.get("ratio") or {}
        if r.get("output_throughput") is not None:
            lines.append(f"  ratio llmkit/llama.cpp (output tok/s, end to end): "
                         f"{r['output_throughput']:.2f}x")
    elif base:
        lines.append(f"  hf:     {base['elapsed_s']:8.2f} s  {base['request_throughput']:9.2f} "
                     f"req/s  {base['output_throughput']:10.1f} output tok/s  (transformers "
                     f"generate, {base['attn_implementation']}, batches of "
                     f"<={base['batch_size']})")
        r = result.get("ratio") or {}
        if r.get("output_throughput") is not None:
            lines.append(f"  ratio llmkit/hf (output tok/s): {r['output_throughput']:.2f}x")
    return "\n".join(lines)
