"""The routed experts of one MoE layer on the CPU: llmkit's grouped path
(``llmkit.ops.moe.fused_moe_grouped``: tokens grouped by expert, one GEMM pair per active
expert) vs Hugging Face's eager experts loop (``Qwen3MoeExperts``), on the same weights and
routing, alternated (A, B, A, B, ...); medians, the spread (min-max) and the ratio.

    python benchmarks/moe_bench.py [--rounds 7] [--hidden 1024] [--inter 384] [--experts 64]
                                   [--top-k 8] [--tokens 1,8,64]

Defaults are a Qwen3-30B-A3B layer at half width (64 experts, top-8); float32, the machine's
torch threads. Compare the two within one run only.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,64")
    args = ap.parse_args()

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from llmkit.ops.moe import fused_moe_grouped, fused_topk

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            experts_implementation="eager")
    torch.manual_seed(0)
    hf = Qwen3MoeExperts(config).eval()
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, args.hidden ** -0.5)
        hf.down_proj.normal_(0, args.inter ** -0.5)
    w13, w2 = hf.gate_up_proj.detach(), hf.down_proj.detach()
    print(f"experts {args.experts} top-{args.top_k}, hidden {args.hidden}, intermediate "
          f"{args.inter}, float32, {torch.get_num_threads()} threads")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden)
        weights, ids = fused_topk(torch.randn(tokens, args.experts), args.top_k, True)
        paths = {"llmkit grouped": lambda: fused_moe_grouped(x, w13, w2, weights, ids),
                 "HF eager loop": lambda: hf(x, ids.long(), weights)}
        with torch.inference_mode():
            torch.testing.assert_close(paths["llmkit grouped"](), paths["HF eager loop"](),
                                       atol=1e-4, rtol=1e-4)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    fn()  # warm
                    t0 = time.perf_counter()
                    for _ in range(5):
                        fn()
                    times[name].append((time.perf_counter() - t0) / 5 * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = ", ".join(f"{name} {med[name]:.2f} ms ({min(ts):.2f}-{max(ts):.2f})"
                        for name, ts in times.items())
        print(f"T={tokens:>4}: {row}; ratio {med['llmkit grouped'] / med['HF eager loop']:.2f}")


if __name__ == "__main__":
    main()
