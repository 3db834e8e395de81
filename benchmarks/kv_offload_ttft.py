"""TTFT of a long shared prefix that the KV pool is too small to keep: recomputed vs loaded from
the host tier vs loaded from the disk tier (kv_offload.*), on the default model.

Each round, per engine (alternated, A, B, C, C, B, A, ...): an evicting request of other tokens
pushes the prefix out of the pool, then prefix + a fresh suffix is timed to its first token.
Prints medians, the spread (min-max) and each tier's ratio to recompute, measured in one
process.

    python benchmarks/kv_offload_ttft.py [--prefix 2000] [--rounds 3] [--threads 0]
        [--compression zstd]   # also a host tier with kv_offload.host_compression=zstd
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time


def _ttft(llm, prompt: list[int]) -> float:
    from llmkit import SamplingParams

    start = time.perf_counter()
    for _ in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)):
        return time.perf_counter() - start
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compression", choices=["zlib", "zstd"], default=None,
                    help="add a host tier whose blocks are compressed so")
    args = ap.parse_args()
    from llmkit import LLM

    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix)]
    block = 16
    # room for the prefix or the evicting request, never both
    num_blocks = (args.prefix + 64) // block + 8
    disk = tempfile.mkdtemp(prefix="llmkit-kv-bench-")
    common = dict(platform={"num_threads": args.threads},
                  kv_cache={"num_blocks": num_blocks, "block_size": block},
                  scheduler={"max_num_batched_tokens": 4096})
    llms = {
        "recompute": LLM(**common),
        "host tier": LLM(**common, kv_offload={"host_gib": 2.0}),
        "disk tier": LLM(**common, kv_offload={"disk_path": disk, "disk_gib": 4.0}),
    }
    if args.compression:
        llms[f"host {args.compression}"] = LLM(**common, kv_offload={
            "host_gib": 2.0, "host_compression": args.compression})
    times: dict[str, list[float]] = {k: [] for k in llms}
    for r in range(args.rounds + 1):  # round 0 warms up (and fills the tiers)
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for name in order:
            llm = llms[name]
            _ttft(llm, [rng.randrange(100, 40000) for _ in range(args.prefix + 32)])  # evict
            t = _ttft(llm, prefix + [rng.randrange(100, 40000) for _ in range(16)])
            if r:
                times[name].append(t)
            print(f"  round {r} {name}: {t * 1e3:.0f} ms{'' if r else ' (warm-up)'}", flush=True)
    base = statistics.median(times["recompute"])
    print(f"TTFT of a {args.prefix}-token prefix evicted from a {num_blocks}-block pool "
          f"({args.rounds} rounds):")
    for name, ts in times.items():
        hits = llms[name].engine.stats().kv_connector
        tier_hits = dict(hits.hits_per_tier) if hits is not None else {}
        print(f"  {name:11s} median {statistics.median(ts) * 1e3:8.1f} ms  "
              f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  "
              f"x{statistics.median(ts) / base:.2f} of recompute  hits {tier_hits}")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
