"""The bf16 linear paths of a decode step, alternated in one process: llmkit's C++ linear
(torch's GEMV order), oneDNN on a packed copy, and the amx tier's AMX-BF16 tile linear, over
30 layers of the default model's shapes plus its LM head (distinct weights, so they stream
from memory as in a real step). Prints each path's median and its time divided by oneDNN's
in the same round (median over rounds). Not a pytest benchmark:

    python benchmarks/bf16_linear_paths.py [--rows 1,8,64,512] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    from llmkit.config.cpu_isa import supported_tiers
    from llmkit.kernels.cpu_native import load_cpu_kernels

    tiles = "amx" in supported_tiers()
    ops = load_cpu_kernels("amx" if tiles else None)
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * args.layers + [HEAD]
    weights = [torch.randn(o, i, generator=g).bfloat16() for o, i in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    tiled = [ops.bf16_tile_pack(w) for w in weights] if tiles else []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=g).bfloat16() for _, i in shapes]
        paths = {"onednn": lambda: [torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], "") for x, p in zip(xs, onednn)]}
        if tiles:
            paths["amx_tiles"] = lambda: [ops.bf16_tile_linear(x, p, w.shape[0], None)
                                          for x, p, w in zip(xs, tiled, weights)]
        if rows <= 8:
            paths["cpp"] = lambda: [ops.linear(x, w, None) for x, w in zip(xs, weights)]
        times: dict[str, list[float]] = {k: [] for k in paths}
        for f in paths.values():
            f()
        for _ in range(args.rounds):
            for name, f in paths.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        mid = args.rounds // 2
        print(rows, {name: f"{sorted(v)[mid] * 1e3:.1f} ms, "
                     f"{sorted(a / b for a, b in zip(v, times['onednn']))[mid]:.2f}x onednn"
                     for name, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()
