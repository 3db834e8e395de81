"""Speculative decoding on the default model (SmolLM2-135M-Instruct), a copy-from-input
workload: tokens/s with and without ``speculative=ngram`` at batch 1, 8, 32, and ``adaptive``
at batch 64 (issue "Speculative decoding": ngram >= 2x at batch 1; adaptive never slower than
no speculation).

The speculative config is the recipe's (``--recipe``, default ``cpu-ngram``: what serving on a
CPU box runs, and what issue 30's figure names): ``adaptive`` is the recipe as it is, ``ngram``
the same with a fixed K (``adaptive=false``); ``--k`` overrides the recipe's K in both. The
engine without speculation is the recipe with ``speculative=none``.

The workload is ``benchmarks/data/copy_prompts.jsonl``: "repeat / fix the spelling of /
rewrite as a list" prompts over short paragraphs, in the model's chat template, greedy, up to
``--max-tokens`` new tokens (EOS ends a request). Every engine runs the same prompts; each run
has its own ``cache_salt`` (no prefix-cache hits between runs). Engines are measured
alternately (A B, B A, ...) in one process and each figure is the median over ``--reps`` runs,
with the spread of the per-run ratios: the machine is shared, so ratios in one process are
what counts. Not a pytest benchmark (it takes minutes): run

    python benchmarks/bench_spec_decode.py [--reps 3] [--batches 1,8,32] [--adaptive-batch 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DATA = Path(__file__).parent / "data" / "copy_prompts.jsonl"


def load_prompts(llm) -> list[list[int]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [llm.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in rows]


def recipe_spec(recipe: str, k: int | None) -> dict:
    """The recipe's speculative section (K = ``k`` if given)."""
    from llmkit.config.compose import build_config

    spec = build_config(None, groups={"recipe": recipe}).speculative.model_dump(
        exclude={"target"})
    if spec["name"] == "none":
        raise SystemExit(f"recipe {recipe!r} runs no speculative decoding")
    if k:
        spec["num_speculative_tokens"] = k
    return spec


def make_engines(k: int | None, threads: int, recipe: str = "cpu-ngram"
                 ) -> tuple[dict, dict, dict]:
    """No speculation and ngram with a fixed K (the recipe's speculative section, K = ``k`` or
    the recipe's), that section and the config all engines share (the recipe, threads).
    Step graphs compile before ``LLM`` returns (``compilation.background=false``, as ``llmkit
    bench`` does), so a cold cache times graphs, not eager steps."""
    from llmkit import LLM

    spec = recipe_spec(recipe, k)
    common = {"recipe": recipe, "platform": {"num_threads": threads},
              "compilation": {"background": False}}
    return ({"none": LLM(None, speculative="none", **common),
             "ngram": LLM(None, speculative={**spec, "adaptive": False}, **common)},
            spec, common)


def run(llm, prompts: list[list[int]], max_tokens: int, salt: str) -> dict:
    from llmkit import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = llm.engine.stats().spec_decode
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], params,
                        use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = llm.engine.stats().spec_decode
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    proposed = after.num_draft_tokens - before.num_draft_tokens
    return {"tok_s": tokens / elapsed, "tok_cpu_s": tokens / cpu, "tokens": tokens,
            "s": elapsed,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "drafts_per_draft": proposed / drafts if drafts else None,
            "acceptance_rate": accepted / proposed if proposed else None,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def compare(engines: dict, names: tuple[str, str], batch: int, prompts: list[list[int]],
            reps: int, max_tokens: int, tag: str) -> dict:
    a, b = names
    res: dict[str, list[dict]] = {a: [], b: []}
    for rep in range(reps):
        # a different slice of the prompts per rep, the same for both engines
        chosen = [prompts[(rep * batch + i) % len(prompts)] for i in range(batch)]
        order = (a, b) if rep % 2 == 0 else (b, a)
        for name in order:
            res[name].append(run(engines[name], chosen, max_tokens, f"{tag}-{rep}-{name}"))
    same = all(x["outputs"] == y["outputs"] for x, y in zip(res[a], res[b]))
    ratios = [y["tok_s"] / x["tok_s"] for x, y in zip(res[a], res[b])]
    cpu_ratios = [y["tok_cpu_s"] / x["tok_cpu_s"] for x, y in zip(res[a], res[b])]
    acc = [r["acceptance_length"] for r in res[b] if r["acceptance_length"] is not None]
    k = [r["drafts_per_draft"] for r in res[b] if r["drafts_per_draft"] is not None]
    return {
        "batch": batch, "baseline": a, "engine": b,
        "baseline_tok_s": statistics.median(r["tok_s"] for r in res[a]),
        "engine_tok_s": statistics.median(r["tok_s"] for r in res[b]),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "ratios": ratios,
        # the same from CPU time (this process's): robust to a busy machine's descheduling
        "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "mean_acceptance_length": statistics.median(acc) if acc else None,
        "mean_k": statistics.median(k) if k else None,  # draft tokens per drafted row
        "greedy_identical": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--adaptive-batch", type=int, default=64)
    ap.add_argument("--engines", default="ngram", help="what the batches in --batches compare "
                    "with no speculation: ngram (fixed K), adaptive, or both (ngram,adaptive)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--recipe", default="cpu-ngram", help="the recipe whose speculative "
                    "section the engines run (and whose other settings all engines share)")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (the recipe's "
                    "if unset)")
    ap.add_argument("--ridge-tokens", type=int, default=None,
                    help="speculative.ridge_tokens for adaptive (default: measured)")
    ap.add_argument("--threads", type=int, default=0, help="platform.num_threads (0 = all); "
                    "1 on a shared machine: no thread waits for a descheduled sibling")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from llmkit import LLM

    engines, spec, common = make_engines(args.k, args.threads, args.recipe)
    print(f"recipe {args.recipe}: speculative {spec}", flush=True)
    compared = [e for e in args.engines.split(",") if e]
    if args.adaptive_batch or "adaptive" in compared:
        adaptive = {**spec, "adaptive": True}
        if args.ridge_tokens is not None:
            adaptive["ridge_tokens"] = args.ridge_tokens
        engines["adaptive"] = LLM(None, speculative=adaptive, **common)
    prompts = load_prompts(engines["none"])
    for llm in engines.values():  # warm-up: first-step costs are no part of any figure
        run(llm, prompts[:4], 32, "warmup")
    results = []
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for name in compared:
            r = compare(engines, ("none", name), batch, prompts, args.reps, args.max_tokens,
                        f"b{batch}-{name}")
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ratios"}), flush=True)
    if args.adaptive_batch:
        for name in ("adaptive", "ngram"):
            r = compare(engines, ("none", name), args.adaptive_batch, prompts, args.reps,
                        args.max_tokens, f"a{args.adaptive_batch}-{name}")
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ratios"}), flush=True)
    if "adaptive" in engines:
        policy = engines["adaptive"].engine.executor.runner.proposer.length_policy
        print(f"adaptive ridge_tokens = {policy.ridge_tokens}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
