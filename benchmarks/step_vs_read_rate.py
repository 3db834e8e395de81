"""How close a batch-1 decode step comes to the machine's memory read rate, measured side by
side: each round reads a 256 MB buffer (``llmkit sim calibrate``'s bandwidth probe) before and
after one greedy generation of ``--tokens`` after a ``--prompt``-token prompt, and prints the
bytes a step reads over the decode steps' mean time (the engine's ``StepTrace``), as a fraction
of the mean of the two reads. On a VM whose memory speed moves within minutes, this ratio is
what says how much of a step is the engine's own work rather than the memory.

A step's bytes are the checkpoint's weight files (a batch-1 step reads every weight once; a
tied head reads the embedding table). An untied model's input embedding is read one row a
step, so there, or for a checkpoint that is repacked bigger, give ``--bytes``.

    python benchmarks/step_vs_read_rate.py [MODEL] [--dtype bfloat16] [--rounds 12]

MODEL is a Hugging Face folder or GGUF (default: the default model).
"""
from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from llmkit.config.openmp_env import apply_engine_openmp_env

apply_engine_openmp_env()  # the engine's wait policy, before torch loads (as `llmkit` sets it)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")


def checkpoint_bytes(path: str) -> int:
    p = Path(path)
    files = [p] if p.is_file() else [f for g in WEIGHT_FILES for f in p.glob(g)]
    return sum(f.stat().st_size for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--bytes", type=int, default=None, help="bytes a step reads")
    args = ap.parse_args()

    import torch

    from llmkit import LLM, SamplingParams
    from llmkit.engine.observe.step_trace import StepTrace
    from llmkit.tools.sim.calibrate import measure_bandwidth

    kw = {"model": args.model} if args.model else {}
    llm = LLM(dtype=args.dtype, compilation={"background": False}, **kw)
    nbytes = args.bytes or checkpoint_bytes(llm.model_source.path)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    trace = StepTrace()
    llm.engine.add_step_observer(trace)

    def generate() -> None:
        prompt = [rng.randrange(1000, 30000) for _ in range(args.prompt)]
        llm.generate([prompt], params, use_tqdm=False)

    generate()
    print(f"a step reads {nbytes / 1e6:.0f} MB; {torch.get_num_threads()} threads")
    fractions = []
    for r in range(args.rounds):
        before = measure_bandwidth(256)["read"] / 1e9
        trace.clear()
        generate()
        decode = [s.step_ms for s in trace.steps if s.decode_tokens and not s.prefill_tokens]
        step_s = statistics.fmean(decode) / 1e3
        after = measure_bandwidth(256)["read"] / 1e9
        rate = nbytes / step_s / 1e9
        fractions.append(rate / ((before + after) / 2))
        print(f"{r}: read {before:.1f} / {after:.1f} GB/s, decode step {step_s * 1e3:.2f} ms = "
              f"{rate:.1f} GB/s, {fractions[-1]:.2f} of the read rate", flush=True)
    print(f"fraction of the read rate: median {statistics.median(fractions):.2f} "
          f"({min(fractions):.2f}-{max(fractions):.2f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
