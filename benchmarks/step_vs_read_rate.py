"""How close a batch-1 decode step comes to the machine's memory read rate, measured side by
side: each round times a `torch.sum` over 256 MB (best of 3) before and after one greedy
generation of ``--tokens`` after a ``--prompt``-token prompt, and prints the bytes the step
reads (the model's weights, counted from its parameters) over the step time, as a fraction of
the mean of the two reads. On a VM whose memory speed moves within minutes, this ratio is what
says how much of a step is the engine's own work rather than the memory.

    python benchmarks/step_vs_read_rate.py [MODEL] [--dtype bfloat16] [--rounds 12]

MODEL is a Hugging Face folder or GGUF (default: the default model).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from llmkit.config.openmp_env import apply_engine_openmp_env

apply_engine_openmp_env()  # the engine's wait policy, before torch loads (as `llmkit` sets it)


def read_rate(x) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def weight_bytes(llm) -> int:
    """The bytes a batch-1 decode step streams: every tensor the model's layers hold (their
    parameters and buffers, and the packed weights their linear methods keep), each storage
    once (a tied head and embedding once), without the input embedding's own table (a step
    reads one row of it)."""
    import torch

    model = llm.engine.executor.runner.model
    seen: set[int] = set()
    total = 0

    def visit(obj, depth: int) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_mkldnn:
                return  # a oneDNN-packed copy: used by batched steps, not read at one row
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth)
        elif depth > 0 and type(obj).__module__.startswith("llmkit."):
            names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
            for name in names:
                visit(getattr(obj, name, None), depth - 1)

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in model.modules():
        if module is embed or isinstance(module, torch.nn.Embedding):
            continue
        for v in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            visit(v, 0)
        for k, v in vars(module).items():
            if not k.startswith("_"):
                visit(v, 3)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    import torch

    from llmkit import LLM, SamplingParams

    kw = {"model": args.model} if args.model else {}
    llm = LLM(dtype=args.dtype, compilation={"background": False}, **kw)
    nbytes = weight_bytes(llm)
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    rng = random.Random(0)
    full = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompt() -> list[list[int]]:
        return [[rng.randrange(1000, 30000) for _ in range(args.prompt)]]

    llm.generate(prompt(), full, use_tqdm=False)
    print(f"model reads {nbytes / 1e6:.0f} MB a step; {torch.get_num_threads()} threads")
    fractions = []
    for r in range(args.rounds):
        before = read_rate(x)
        t = time.perf_counter()
        llm.generate(prompt(), first, use_tqdm=False)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompt(), full, use_tqdm=False)
        step = (time.perf_counter() - t - prefill) / (args.tokens - 1)
        after = read_rate(x)
        rate = nbytes / step / 1e9
        fractions.append(rate / ((before + after) / 2))
        print(f"{r}: torch.sum {before:.1f} / {after:.1f} GB/s, step {step * 1e3:.2f} ms = "
              f"{rate:.1f} GB/s, {fractions[-1]:.2f} of the read rate", flush=True)
    print(f"fraction of the read rate: median {statistics.median(fractions):.2f} "
          f"({min(fractions):.2f}-{max(fractions):.2f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
