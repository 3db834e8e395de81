"""Speculation is free until the batch fills the machine: the simulated speed-up of
``speculative=ngram`` (fixed K, and ``adaptive``) over no speculation against the number of
requests in flight, on a modelled accelerator (default: A100 80GB, Llama-2-7B in bf16).

Each point is a ``llmkit sim`` run of the same workload (``bench.max_concurrency`` requests in
flight, all arrived at 0) with the ``speculative`` group and its acceptance model
(``speculative.acceptance_rates``); the ratio is output tokens/s over the run without
speculation. Past the ridge point rows x (1 + K) turn the verify steps compute-bound and a
fixed K costs more than its accepted drafts gain; adaptive K falls to 0 there.

    python benchmarks/sim_spec_curve.py [--hardware a100-80gb] [--model llama-2-7b] [--k 4]
        [--out sim_spec_curve.png]
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rates", default="0.6,0.4,0.3",
                    help="speculative.acceptance_rates (per position)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default="sim_spec_curve.png")
    args = ap.parse_args()

    from llmkit.tools.compose import compose_tool_config
    from llmkit.tools.schema import SimToolConfig
    from llmkit.tools.sim.replay import run_sim

    def throughput(conc: int, extra: list[str]) -> tuple[float, dict | None]:
        cfg = compose_tool_config(SimToolConfig, [
            f"sim.model={args.model}", f"hardware={args.hardware}",
            f"bench.num_requests={max(2 * conc, 16)}", f"bench.max_concurrency={conc}",
            f"bench.input_len={args.input_len}", f"bench.output_len={args.output_len}",
            "bench.progress=false", f"scheduler.max_num_seqs={max(conc, 1)}",
            "scheduler.max_num_batched_tokens=8192", *extra])
        res = run_sim(cfg)
        return res["summary"]["output_throughput"], res["sim"].get("spec_decode")

    spec = ["speculative=ngram", f"speculative.num_speculative_tokens={args.k}",
            f"speculative.acceptance_rates=[{args.rates}]"]
    rows = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        base, _ = throughput(conc, [])
        fixed, sf = throughput(conc, spec)
        adaptive, sa = throughput(conc, spec + ["speculative.adaptive=true"])
        row = {"concurrency": conc, "none_tok_s": base, "fixed_ratio": fixed / base,
               "adaptive_ratio": adaptive / base, "ridge_tokens": sf["ridge_tokens"],
               "fixed_acceptance_length": sf["mean_acceptance_length"],
               "adaptive_draft_tokens": sa["num_draft_tokens"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = [r["concurrency"] for r in rows]
    ax.plot(xs, [r["fixed_ratio"] for r in rows], "o-", label=f"ngram, K={args.k}")
    ax.plot(xs, [r["adaptive_ratio"] for r in rows], "s--", label=f"ngram, adaptive K<={args.k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ridge = rows[0]["ridge_tokens"]
    ax.axvline(ridge / (1 + args.k), color="red", lw=0.8, ls=":",
               label=f"rows x (1+K) = ridge ({ridge} tokens)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens/s over no speculation")
    ax.set_title(f"{args.model} on {args.hardware} (simulated), acceptance {args.rates}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
