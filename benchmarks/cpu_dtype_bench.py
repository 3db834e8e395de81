"""Which dtype ``model.dtype=auto`` should pick on this CPU: float32 vs bfloat16 on the default
model (SmolLM2-135M), for a chat-like request (one prompt, its decode) and a batch job (many
prompts at once), alternated in one process (A, B, A, B, ...) so that a busy machine slows
both alike; prints medians and the spread of each figure.

    python benchmarks/cpu_dtype_bench.py [--rounds 3] [--batch 16] [--threads 0]

The choice itself is ``CpuPlatform.preferred_dtype`` (llmkit/platforms/cpu.py).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def _run(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token of the first prompt, output tokens / s overall)."""
    from llmkit import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = None
    n = 0
    if len(prompts) == 1:
        for out in llm.stream(prompts[0], params):
            if first is None:
                first = time.perf_counter() - start
            n += len(out.outputs[0].token_ids)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return (first or elapsed), n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    from llmkit import LLM

    rng = random.Random(0)
    chat = [[rng.randrange(100, 40000) for _ in range(128)]]
    batch = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(args.batch)]
    llms = {d: LLM(dtype=d, platform={"num_threads": args.threads},
                   kv_cache={"num_blocks": 1024}, scheduler={"max_num_seqs": args.batch})
            for d in ("float32", "bfloat16")}
    for llm in llms.values():  # warm-up
        _run(llm, chat, 4)
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for d in order:
            ttft, tps = _run(llms[d], chat, 64)
            results.setdefault((d, "chat TTFT s"), []).append(ttft)
            results.setdefault((d, "chat tok/s"), []).append(tps)
            _, tps = _run(llms[d], batch, 32)
            results.setdefault((d, f"batch {args.batch} tok/s"), []).append(tps)
    for (d, what), xs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{what:>16} {d:>9}: median {statistics.median(xs):8.3f}  "
              f"min {min(xs):8.3f}  max {max(xs):8.3f}  (n={len(xs)})")
    for what in sorted({w for _, w in results}):
        ratio = [b / a for a, b in zip(results[("float32", what)], results[("bfloat16", what)])]
        print(f"{what:>16} bf16/fp32 per round: {', '.join(f'{x:.2f}' for x in ratio)}")


if __name__ == "__main__":
    main()
