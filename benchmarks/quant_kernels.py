"""Speed of the quantized linears (``llmkit.kernels.quant``) against float32 (torch / MKL) and
llmkit's bf16 GEMV, on SmolLM2-135M's layer shapes, as alternated medians in one process.

GEMV (decode, 1-8 rows): each candidate runs over a stack of ``--layers`` distinct weights
(more bytes than the last-level cache) so the weight streams from DRAM as in a decode step;
reported as GB/s of weight bytes read. GEMM (prefill, 64-512 rows): one weight (compute bound);
reported as GFLOP/s (2 * rows * out * in per call).

    python benchmarks/quant_kernels.py                 # all formats, rows 1 4 8 64 512
    python benchmarks/quant_kernels.py --rows 1 --formats q4_1 q8_0 --threads 1

Each line: median time per layer call, the spread (25th-75th percentile) as a percentage of
the median, and the ratio to float32 at the same rows, all from the same alternated rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.quant import weights

from helpers.gguf_rows import random_gguf_rows

# SmolLM2-135M: (out, in) of q/k/v fused, o, gate/up fused, down; the LM head separately.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
GGUF = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")


def make_weight(fmt: str, n: int, k: int, seed: int):
    if fmt in GGUF:
        if fmt in ("q4_k", "q6_k") and k % 256:
            k = 512 if k < 1024 else 1536
        return weights.pack_gguf(random_gguf_rows(fmt, n, k, seed=seed), fmt, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return weights.quantize_int8(w) if fmt == "int8" else weights.quantize_fp8(w)


def alternated(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def spread(ts: list[float]) -> float:
    q = statistics.quantiles(ts, n=4)
    return (q[2] - q[0]) / statistics.median(ts) * 100


def bench_gemv(formats, rows: int, layers: int, rounds: int, ops) -> dict[str, float]:
    """Median seconds per pass over the stack, by candidate."""
    shapes = [LAYER[i % len(LAYER)] for i in range(layers)]
    dense = [torch.randn(n, k) * 0.05 for n, k in shapes]
    dense_bf = [w.bfloat16() for w in dense]
    xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    xs_bf = {k: v.bfloat16() for k, v in xs.items()}
    fns: dict[str, Callable] = {
        "float32 F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in dense],
        "bf16 llmkit linear": lambda: [ops.linear(xs_bf[w.shape[1]], w, None) for w in dense_bf],
    }
    nbytes = {"float32 F.linear": sum(w.numel() * 4 for w in dense),
              "bf16 llmkit linear": sum(w.numel() * 2 for w in dense)}
    for fmt in formats:
        packed = [make_weight(fmt, n, k, i) for i, (n, k) in enumerate(shapes)]
        def run(packed=packed, **kw):
            for p in packed:
                x = xs.get(p.in_features)
                if x is None:
                    x = xs[p.in_features] = torch.randn(rows, p.in_features)
                weights.quant_linear(x, p, **kw)
        fns[fmt] = run
        nbytes[fmt] = sum(p.nbytes for p in packed)
        if fmt in ("q4_0", "q4_1"):
            fns[fmt + " float-act"] = lambda run=run: run(float_activations=True)
            nbytes[fmt + " float-act"] = nbytes[fmt]
    times = alternated(fns, rounds)
    base = statistics.median(times["float32 F.linear"])
    print(f"\nGEMV rows={rows}: {layers} weights, {nbytes['float32 F.linear'] / 1e6:.0f} MB as "
          f"float32, threads={torch.get_num_threads()}")
    medians = {}
    for name, ts in times.items():
        med = medians[name] = statistics.median(ts)
        print(f"  {name:20s} {med / layers * 1e6:8.1f} us/layer  {nbytes[name] / med / 1e9:6.1f} GB/s"
              f"  {base / med:5.2f}x f32   spread {spread(ts):4.0f}%")
    return medians


def bench_gemm(formats, rows: int, rounds: int, ops) -> dict[str, float]:
    """Speed relative to float32 F.linear (same FLOPs counted), by candidate."""
    n, k = 3072, 576
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    fns: dict[str, Callable] = {"float32 F.linear": lambda: F.linear(x, w)}
    flops = {"float32 F.linear": 2 * rows * n * k}
    for fmt in formats:
        p = make_weight(fmt, n, k, 0)
        xk = x if p.in_features == k else torch.randn(rows, p.in_features)
        fns[fmt] = lambda p=p, xk=xk: weights.quant_linear(xk, p)
        flops[fmt] = 2 * rows * n * p.in_features
    times = alternated(fns, rounds)
    base = statistics.median(times["float32 F.linear"]) / flops["float32 F.linear"]
    print(f"\nGEMM rows={rows}: [{n}, {k}] (k-quants: in 512), threads={torch.get_num_threads()}")
    ratios = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        ratios[name] = base * flops[name] / med
        print(f"  {name:20s} {med * 1e3:8.2f} ms  {flops[name] / med / 1e9:6.1f} GFLOP/s"
              f"  {ratios[name]:5.2f}x f32   spread {spread(ts):4.0f}%")
    return ratios


def smollm2_step_weights(path: str):
    """The default model's linears as a decode step runs them: per layer q|k|v and gate|up
    fused (the packed groups of eight rows concatenate), o and down; then the tied Q8_0
    embedding as the LM head -- all in the file's own formats."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}

    def pack(name):
        t = raw[name]
        fmt = t.tensor_type.name.lower()
        k = int(t.shape[0])
        return weights.pack_gguf(torch.from_numpy(t.data.copy()).reshape(int(t.shape[1]), -1), fmt, k)

    def fuse(parts):
        return weights.PackedWeight(parts[0].format, sum(p.out_features for p in parts),
                                    parts[0].in_features, torch.cat([p.data for p in parts]))

    layers = []
    n_layers = 1 + max(int(n.split(".")[1]) for n in raw if n.startswith("blk."))
    for i in range(n_layers):
        b = f"blk.{i}."
        layers += [fuse([pack(b + "attn_q.weight"), pack(b + "attn_k.weight"), pack(b + "attn_v.weight")]),
                   pack(b + "attn_output.weight"),
                   fuse([pack(b + "ffn_gate.weight"), pack(b + "ffn_up.weight")]),
                   pack(b + "ffn_down.weight")]
    head = pack("output.weight" if "output.weight" in raw else "token_embd.weight")
    return layers, head


def bench_smollm2(path: str, rows_list, rounds: int) -> dict[int, float]:
    """Median seconds of one decode step's linears, by rows."""
    layers, head = smollm2_step_weights(path)
    result = {}
    nbytes = sum(p.nbytes for p in layers) + head.nbytes
    for rows in rows_list:
        xs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        def step():  # every row decodes a sequence: every row needs its logits
            for p in layers:
                weights.quant_linear(xs[p.in_features], p)
            weights.quant_linear(xs[576], head)
        def head_only():
            weights.quant_linear(xs[576], head)
        times = alternated({"step": step, "head": head_only}, rounds)
        med = result[rows] = statistics.median(times["step"])
        print(f"SmolLM2 decode-step linears, rows={rows}, threads={torch.get_num_threads()}: "
              f"{med * 1e3:.2f} ms ({nbytes / med / 1e9:.1f} GB/s of {nbytes / 1e6:.0f} MB; "
              f"LM head alone, cache-warm: {statistics.median(times['head']) * 1e3:.2f} ms), spread {spread(times['step']):.0f}%"
              f" -> at most {rows / med:.0f} tok/s from the linears alone")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=[*GGUF, "int8", "fp8"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 64, 512])
    ap.add_argument("--layers", type=int, default=120,
                    help="GEMV: distinct weights per pass (120: all of SmolLM2-135M's layers)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--smollm2", metavar="GGUF", help="instead: one decode step's linears of "
                    "this SmolLM2 GGUF, in its own formats, for --rows")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_cpu_kernels()
    if args.smollm2:
        bench_smollm2(args.smollm2, args.rows, args.rounds)
        return
    for rows in args.rows:
        if rows <= 8:
            bench_gemv(args.formats, rows, args.layers, args.rounds, ops)
        else:
            bench_gemm(args.formats, rows, args.rounds, ops)


if __name__ == "__main__":
    main()
