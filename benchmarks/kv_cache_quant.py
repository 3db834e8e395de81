"""What a quantized KV cache costs the CPU decode attention: the C++ ``paged_decode_attention``
over an int8 / e4m3 / bf16 pool vs the model-dtype pool, SmolLM2-135M's heads (9 query heads,
3 KV heads, head_dim 64), alternated in one process, medians and spread.

    python benchmarks/kv_cache_quant.py [--batch 8] [--context 512] [--dtype float32]

Prints, per cache dtype, the median time of one layer's decode attention and its ratio to the
model-dtype pool (> 1 = slower), and the pool's bytes per token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.kv_quant import FORMATS, quantize_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ops = load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    nb = -(-args.context // block)
    num_blocks = args.batch * nb
    x = torch.randn(2, num_blocks, block, kv_heads, dim)
    pools = {"auto": x.to(dtype), "bfloat16": x.to(torch.bfloat16)}
    pools.update({name: quantize_rows(x, fmt) for name, fmt in FORMATS.items()})
    if dtype == torch.bfloat16:
        del pools["bfloat16"]
    q = torch.randn(args.batch, heads, dim).to(dtype)
    table = torch.randperm(num_blocks).view(args.batch, nb).to(torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    times: dict[str, list[float]] = {k: [] for k in pools}
    for _ in range(args.reps):
        for name, pool in pools.items():  # alternated: A, B, C, A, B, C, ...
            t0 = time.perf_counter()
            ops.paged_decode_attention(q, pool, table, lens, dim ** -0.5)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["auto"])
    print(f"batch {args.batch}, context {args.context}, q {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / med
        per_token = 2 * kv_heads * pools[name].shape[-1] * pools[name].element_size()
        print(f"  {name:9s} {med * 1e3:7.3f} ms  x{med / base:5.2f}  (spread {spread:4.0%}, "
              f"{per_token} bytes/token/layer)")


if __name__ == "__main__":
    main()
