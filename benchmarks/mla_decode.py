"""MLA decode on CPUs: the absorbed attention over the latent cache (the C++
``mla_decode_attention``: one 576-wide latent row per token read once for all heads) vs the
expanded form (K/V up-projected per head and cached, read by the C++ ``paged_decode_attention``),
DeepSeek-V2-Lite's shapes: 16 heads, kv_lora_rank 512, rope 64, qk_nope 128, v 128.

    python benchmarks/mla_decode.py [--batch 1 32] [--context 512] [--dtype bfloat16]

Variants, alternated in one process (A, B, C, A, B, C, ...), medians and spread:

- ``absorbed``: the latent attention alone, ``[B, 16, 512]`` out.
- ``absorbed+proj``: plus what absorption adds to the model's step: ``q_nope @ W_UK`` per head
  (128 -> 512) before and ``@ W_UV`` (512 -> 128) after, as batched matmuls.
- ``expanded``: the existing paged decode attention over per-head K = [k_nope | k_pe] (192) and
  V (128, zero-padded to 192: that kernel takes one head_dim for K and V, as vLLM pads V for
  its flash kernels).

Prints each variant's median time per layer, its ratio to ``expanded`` (< 1 = faster) and the
cache bytes per token per layer; the load average before and after (timings are noisy on a
shared machine: a ratio of variants measured together is the figure to read).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmkit.kernels.cpu_native import load_cpu_kernels

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128


def bench(ops, batch: int, context: int, dtype: torch.dtype, reps: int) -> None:
    block = 16
    nb = -(-context // block)
    num_blocks = batch * nb
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=g).view(batch, nb).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    latent = torch.randn(num_blocks, block, RANK + ROPE, generator=g).to(dtype)
    # Expanded: K [k_nope | k_pe] per head, V per head padded to K's width.
    kv = torch.zeros(2, num_blocks, block, HEADS, NOPE + ROPE, dtype=dtype)
    kv[0] = torch.randn(num_blocks, block, HEADS, NOPE + ROPE, generator=g).to(dtype)
    kv[1, ..., :V] = torch.randn(num_blocks, block, HEADS, V, generator=g).to(dtype)
    q_nope = torch.randn(batch, HEADS, NOPE, generator=g).to(dtype)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=g).to(dtype)
    q_full = torch.cat([q_nope, q_pe], -1).contiguous()
    w_uk = (torch.randn(HEADS, NOPE, RANK, generator=g) * 0.05).to(dtype)
    w_uv = (torch.randn(HEADS, RANK, V, generator=g) * 0.05).to(dtype)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
    scale = (NOPE + ROPE) ** -0.5

    def absorbed():
        ops.mla_decode_attention(q_latent, q_pe, latent, table, lens, scale)

    def absorbed_proj():
        ql = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
        o = ops.mla_decode_attention(ql, q_pe, latent, table, lens, scale)
        torch.bmm(o.transpose(0, 1), w_uv)

    def expanded():
        ops.paged_decode_attention(q_full, kv, table, lens, scale)

    variants = {"absorbed": absorbed, "absorbed+proj": absorbed_proj, "expanded": expanded}
    per_token = {"absorbed": (RANK + ROPE), "absorbed+proj": (RANK + ROPE),
                 "expanded": 2 * HEADS * (NOPE + ROPE)}
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["expanded"])
    print(f"batch {batch}, context {context}, {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads, {reps} reps")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / med
        ratios = sorted(t / e for t, e in zip(ts, times["expanded"]))
        print(f"  {name:14s} {med * 1e3:8.3f} ms  x{med / base:5.2f} of expanded "
              f"(per-rep ratio {ratios[0]:.2f}..{ratios[-1]:.2f}; spread {spread:4.0%}; "
              f"{per_token[name] * torch.empty((), dtype=dtype).element_size()} "
              "cache bytes/token/layer)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    ops = load_cpu_kernels()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs)")
    for batch in args.batch:
        bench(ops, batch, args.context, getattr(torch, args.dtype), args.reps)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
