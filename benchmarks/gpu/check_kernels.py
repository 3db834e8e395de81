"""Check every llmkit Triton kernel against its torch reference on a CUDA GPU, then measure:

* paged decode attention: achieved memory bandwidth (GB/s and % of the device's peak) at
  batch 1 / 32 / 128 and context 1k / 8k (Llama-3-8B attention: 32 query heads, 8 KV heads,
  head_dim 128, bf16, block size 16), split over the KV length as the triton backend does;
* the unified (prefill) kernel: TFLOP/s on causal prefills, fresh and chunked, and a mixed batch.

Usage: ``python benchmarks/gpu/check_kernels.py [--quick] [--peak-gbps N]``. Exit status 0 when
every check passes, 1 when one fails. Without a CUDA GPU it says so and exits 0 having checked
nothing (the CPU tests run the same kernels in Triton's interpreter: ``pytest
tests/test_kernels_*.py tests/test_triton_backend.py``); ``--smoke`` runs this script's own
logic there on tiny float32 shapes under the interpreter (timings meaningless).

Definitions. Decode bytes: K and V of every context token (``2 * ctx * kv_heads * head_dim *
2 B``) plus q, the output and the block table -- the least the kernel must move; GB/s = bytes /
median time (``triton.testing.do_bench``, which flushes L2 between runs), peak from the
driver's memory clock x bus width (or a table by device name, or ``--peak-gbps``). Prefill
FLOPs: ``4 * heads * head_dim * visible (query, key) pairs`` -- causal pairs only, two matmuls
of 2 FLOP per multiply-add.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

# Peak HBM bandwidth (GB/s) by device name, where the driver's clock/bus figures are missing.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864,
             "L4": 300, "A10G": 600, "RTX 4090": 1008, "RTX 3090": 936, "V100": 900}


@dataclass
class Sizes:
    """Shapes of the checks: serving-sized on a GPU, tiny for ``--smoke`` (interpreter)."""

    dtypes: tuple
    tokens: int  # reshape_and_cache / elementwise rows
    decode_ctx: tuple
    unified_q: tuple
    unified_ctx: tuple
    hidden: tuple
    mlp: tuple
    heads: tuple  # (query heads, kv heads) of the attention checks
    decode_batches: tuple
    decode_ctxs: tuple
    prefill_cases: tuple
    moe: tuple = ()  # fused_moe: (tokens, hidden, intermediate, experts, top_k)


GPU = Sizes(
    dtypes=(torch.bfloat16, torch.float16, torch.float32), tokens=1000,
    decode_ctx=(1, 100, 1000, 4097, 2500, 33, 64, 777),
    unified_q=(1, 517, 64, 1, 300, 7, 1), unified_ctx=(900, 0, 1000, 31, 2048, 0, 4000),
    hidden=(4096, 576, 8192), mlp=(14336, 1536), heads=(32, 8),
    decode_batches=(1, 32, 128), decode_ctxs=(1024, 8192),
    prefill_cases=(("4 x 2048 fresh", (2048,) * 4, (0,) * 4),
                   ("1 x 8192 fresh", (8192,), (0,)),
                   ("8 x 512 chunks after 4096 cached", (512,) * 8, (4096,) * 8),
                   ("2 x 1024 fresh + 64 decodes at 2k", (1024, 1024) + (1,) * 64,
                    (0, 0) + (2048,) * 64)),
    moe=((1, 4096, 1792, 8, 2), (300, 2048, 768, 64, 8), (37, 1024, 512, 8, 2)),
)
SMOKE = Sizes(
    dtypes=(torch.float32,), tokens=24, decode_ctx=(1, 37, 70), unified_q=(1, 19, 5),
    unified_ctx=(30, 0, 17), hidden=(64,), mlp=(96,), heads=(4, 1), decode_batches=(1, 2),
    decode_ctxs=(32,), prefill_cases=(("1 x 24 fresh", (24,), (0,)),),
    moe=((1, 64, 32, 4, 2), (21, 64, 48, 8, 2)),
)


def peak_gbps(props) -> tuple[float, str]:
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    for name, gbps in PEAK_GBPS.items():
        if name.lower() in props.name.lower():
            return float(gbps), f"table entry {name!r}"
    return float("nan"), "unknown: pass --peak-gbps"


def time_ms(fn, dev: torch.device) -> float:
    if dev.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
              exact: bool = False) -> None:
        from helpers.kernel_inputs import tolerances

        tol = {"atol": 0.0, "rtol": 0.0} if exact else tolerances(dtype)
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        try:
            torch.testing.assert_close(got.float(), want.float(), **tol)
        except AssertionError as e:
            self.failures.append(name)
            print(f"  FAIL  {name:<62} max|err| {err:.2e}: {str(e).splitlines()[0]}")
            return
        self.passed += 1
        print(f"  ok    {name:<62} max|err| {err:.2e}")


def check_correctness(c: Checker, dev: torch.device, sz: Sizes) -> None:
    from llmkit.kernels import (fused_add_rms_norm, fused_add_rms_norm_ref,
                                paged_decode_attention, paged_decode_attention_ref,
                                reshape_and_cache, reshape_and_cache_ref, rms_norm, rms_norm_ref,
                                rotary_embedding, rotary_embedding_ref, silu_and_mul,
                                silu_and_mul_ref, unified_attention, unified_attention_ref)
    from helpers.kernel_inputs import make_paged_batch

    torch.manual_seed(0)
    n = sz.tokens

    def rnd(*shape, dtype):
        return torch.randn(*shape, device=dev).to(dtype)

    heads, kv_heads = sz.heads
    for dtype in sz.dtypes:
        t = str(dtype).removeprefix("torch.")
        # reshape_and_cache: bit-exact; K a strided view of a fused qkv; slot -1 skipped.
        for bs, hkv, d in [(16, kv_heads, 128), (32, 4, 64), (16, 2, 80)]:
            blocks = n // bs + 4
            k = rnd(n, 3 * hkv, d, dtype=dtype)[:, hkv:2 * hkv]
            v = rnd(n, hkv, d, dtype=dtype)
            cache = rnd(2, blocks, bs, hkv, d, dtype=dtype)
            slots = torch.randperm(blocks * bs, device=dev)[:n]
            slots[::7] = -1
            ref = cache.clone()
            reshape_and_cache(k, v, cache, slots)
            reshape_and_cache_ref(k, v, ref, slots)
            c.close(f"reshape_and_cache {t} bs={bs} kv_heads={hkv} d={d}", cache, ref, dtype,
                    exact=True)
        # Paged decode: GQA 1/2/4/8, head dims 64/80/96/128, block sizes 16/32, splits.
        for bs, hkv, group, d, splits in [(16, kv_heads, heads // kv_heads, 128, 1),
                                          (16, kv_heads, heads // kv_heads, 128, 8),
                                          (32, 1, 8, 128, 4), (16, 2, 1, 64, 2),
                                          (32, 1, 4, 80, 3), (16, 1, 2, 96, 1)]:
            ctx = sz.decode_ctx
            q, cache, _, seq_lens, bt = make_paged_batch(
                [1] * len(ctx), [x - 1 for x in ctx], num_heads=hkv * group, num_kv_heads=hkv,
                head_dim=d, block_size=bs, dtype=dtype, device=dev, seed=d + splits)
            out = paged_decode_attention(q, cache, bt, seq_lens, d ** -0.5, num_splits=splits)
            c.close(f"paged_decode {t} bs={bs} kv={hkv} gqa={group} d={d} splits={splits}",
                    out, paged_decode_attention_ref(q, cache, bt, seq_lens, d ** -0.5), dtype)
        # Unified varlen: prefills, chunked prefills and decodes in one batch.
        for bs, hkv, group, d in [(16, kv_heads, heads // kv_heads, 128), (32, 2, 1, 128),
                                  (16, 1, 8, 64), (16, 2, 2, 80), (32, 1, 3, 96)]:
            q, cache, qsl, seq_lens, bt = make_paged_batch(
                sz.unified_q, sz.unified_ctx, num_heads=hkv * group, num_kv_heads=hkv,
                head_dim=d, block_size=bs, dtype=dtype, device=dev, seed=d * group)
            out = unified_attention(q, cache, qsl, seq_lens, bt, d ** -0.5)
            c.close(f"unified_attention {t} bs={bs} kv={hkv} gqa={group} d={d}", out,
                    unified_attention_ref(q, cache, qsl, seq_lens, bt, d ** -0.5), dtype)
        # Fused elementwise kernels.
        for rows in (1, n):
            for hidden in sz.hidden:
                x, res = rnd(rows, hidden, dtype=dtype), rnd(rows, hidden, dtype=dtype)
                w = rnd(hidden, dtype=dtype)
                c.close(f"rms_norm {t} {rows}x{hidden}", rms_norm(x, w, 1e-6),
                        rms_norm_ref(x, w, 1e-6), dtype)
                r1, r2 = res.clone(), res.clone()
                o1, _ = fused_add_rms_norm(x, r1, w, 1e-6)
                o2, _ = fused_add_rms_norm_ref(x, r2, w, 1e-6)
                c.close(f"fused_add_rms_norm {t} {rows}x{hidden} residual", r1, r2, dtype)
                c.close(f"fused_add_rms_norm {t} {rows}x{hidden} out", o1, o2, dtype)
            for d in sz.mlp:
                x = rnd(rows, 2 * d, dtype=dtype) * 4
                c.close(f"silu_and_mul {t} {rows}x{d}", silu_and_mul(x), silu_and_mul_ref(x),
                        dtype)
        for neox in (True, False):
            for hq, hkv, d in [(heads, kv_heads, 128), (14, 2, 64), (4, 4, 80), (3, 1, 96)]:
                cache = rnd(4096, d, dtype=dtype)
                pos = torch.randint(0, 4096, (n,), device=dev)
                qkv = rnd(n, hq + 2 * hkv, d, dtype=dtype)
                q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
                qr, kr = q.clone(), k.clone()
                rotary_embedding(pos, q, k, cache, neox)
                rotary_embedding_ref(pos, qr, kr, cache, neox)
                name = f"rotary {'neox' if neox else 'gptj'} {t} heads={hq}/{hkv} d={d}"
                c.close(name + " q", q, qr, dtype)
                c.close(name + " k", k, kr, dtype)
        check_fused_moe(c, dev, sz, dtype)


def check_fused_moe(c: Checker, dev: torch.device, sz: Sizes, dtype: torch.dtype) -> None:
    """The Triton fused-MoE kernel against the grouped torch path (itself tested against the
    definition, ``fused_moe_reference``, on the CPU), all experts here and expert parallel
    (this rank holding the second half of the experts)."""
    from llmkit.kernels import fused_moe
    from llmkit.ops.moe import fused_moe_grouped, fused_topk

    t = str(dtype).removeprefix("torch.")
    for tokens, hidden, inter, experts, top_k in sz.moe:
        x = torch.randn(tokens, hidden, device=dev).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) / hidden ** 0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=dev) / inter ** 0.5).to(dtype)
        weights, ids = fused_topk(torch.randn(tokens, experts, device=dev), top_k, True)
        name = f"fused_moe {t} T={tokens} H={hidden} I={inter} E={experts} k={top_k}"
        c.close(name, fused_moe(x, w13, w2, weights, ids),
                fused_moe_grouped(x, w13, w2, weights, ids), dtype)
        half = experts // 2
        emap = torch.full((experts,), -1, dtype=torch.int32, device=dev)
        emap[half:] = torch.arange(experts - half, dtype=torch.int32, device=dev)
        c.close(name + " expert-parallel", fused_moe(x, w13[half:], w2[half:], weights, ids, emap),
                fused_moe_grouped(x, w13[half:], w2[half:], weights, ids, emap), dtype)


def bench_decode(dev: torch.device, peak: float, sz: Sizes, quick: bool) -> None:
    from llmkit.kernels import default_num_splits, paged_decode_attention

    heads, hkv = sz.heads
    d, bs = 128, 16
    dtype = sz.dtypes[0]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 1
    print(f"\npaged decode attention: {heads} heads, {hkv} KV heads, head_dim {d}, "
          f"{str(dtype).removeprefix('torch.')}, block {bs}; splits as the triton backend "
          f"picks them (target {2 * sms} programs)")
    print(f"  {'batch':>5} {'ctx':>6} {'splits':>6} {'time us':>9} {'GB/s':>8} {'% peak':>7}")
    for batch in sz.decode_batches:
        for ctx in sz.decode_ctxs:
            if quick and batch * ctx > 32 * 8192:
                continue
            nblk = ctx // bs
            cache = torch.randn(2, batch * nblk, bs, hkv, d, device=dev, dtype=dtype)
            bt = torch.randperm(batch * nblk, device=dev).view(batch, nblk).to(torch.int32)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, heads, d, device=dev, dtype=dtype)
            out = torch.empty_like(q)
            splits = default_num_splits(batch, hkv, ctx, target_programs=2 * sms)
            ms = time_ms(lambda: paged_decode_attention(q, cache, bt, seq_lens, d ** -0.5,
                                                        num_splits=splits, out=out), dev)
            nbytes = (2 * batch * ctx * hkv * d + 2 * q.numel()) * q.element_size() \
                + bt.numel() * 4
            gbps = nbytes / (ms * 1e-3) / 1e9
            print(f"  {batch:>5} {ctx:>6} {splits:>6} {ms * 1e3:>9.1f} {gbps:>8.0f} "
                  f"{100 * gbps / peak:>6.1f}%")
            del cache


def bench_prefill(dev: torch.device, sz: Sizes) -> None:
    from llmkit.kernels import choose_block_q, unified_attention, unified_attention_tiles
    from helpers.kernel_inputs import make_paged_batch

    heads, hkv = sz.heads
    d, bs = 128, 16
    dtype = sz.dtypes[0]
    print(f"\nunified attention (prefill): {heads} heads, {hkv} KV heads, head_dim {d}, "
          f"{str(dtype).removeprefix('torch.')}, block {bs}")
    print(f"  {'case':<36} {'time ms':>8} {'TFLOP/s':>8}")
    for name, q_lens, ctx in sz.prefill_cases:
        q, cache, qsl, seq_lens, bt = make_paged_batch(
            q_lens, ctx, num_heads=heads, num_kv_heads=hkv, head_dim=d, block_size=bs,
            dtype=dtype, device=dev)
        out = torch.empty_like(q)
        block_q = choose_block_q(max(q_lens), heads // hkv)
        tiles = (*unified_attention_tiles(qsl.tolist(), block_q, dev), block_q)
        ms = time_ms(lambda: unified_attention(q, cache, qsl, seq_lens, bt, d ** -0.5, out=out,
                                               tiles=tiles), dev)
        pairs = sum(c * n + n * (n + 1) // 2 for n, c in zip(q_lens, ctx))
        tflops = 4 * heads * d * pairs / (ms * 1e-3) / 1e12
        print(f"  {name:<36} {ms:>8.3f} {tflops:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="bf16 checks only; skip the largest decode batch")
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="the device's peak memory bandwidth (default: from the driver)")
    ap.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU: run this script's logic on tiny float32 shapes in Triton's "
                         "interpreter (sets TRITON_INTERPRET=1; timings meaningless)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read at each launch by llmkit.kernels
        dev, sz, peak, source = torch.device("cpu"), SMOKE, float("nan"), "n/a (smoke)"
        print("smoke run on the CPU in Triton's interpreter: tiny float32 shapes; the timings "
              "below say nothing about a GPU")
    elif not torch.cuda.is_available():
        print("check_kernels: no CUDA GPU on this machine (torch.cuda.is_available() is False): "
              "nothing checked. The CPU tests run these kernels in Triton's interpreter: "
              "pytest tests/test_kernels_*.py tests/test_triton_backend.py "
              "(or run this script with --smoke)", file=sys.stderr)
        return 0
    else:
        import triton

        dev = torch.device("cuda")
        sz = GPU
        if args.quick:
            sz = Sizes(**{**GPU.__dict__, "dtypes": (torch.bfloat16,)})
        props = torch.cuda.get_device_properties(dev)
        peak, source = peak_gbps(props)
        if args.peak_gbps:
            peak, source = args.peak_gbps, "--peak-gbps"
        print(f"device: {props.name}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB; peak memory bandwidth {peak:.0f} GB/s "
              f"({source}); torch {torch.__version__}, triton {triton.__version__}")
    print("\ncorrectness (kernel vs its torch reference):")
    checker = Checker()
    check_correctness(checker, dev, sz)
    if not args.skip_bench:
        bench_decode(dev, peak, sz, args.quick)
        bench_prefill(dev, sz)
    if checker.failures:
        print(f"\n{len(checker.failures)} of {checker.passed + len(checker.failures)} checks "
              f"FAILED: {', '.join(checker.failures)}")
        return 1
    print(f"\nall {checker.passed} kernel checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
