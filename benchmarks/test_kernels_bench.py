"""Microbenchmarks of llmkit.kernels: each Triton kernel next to its torch reference, in one
pytest-benchmark group per kernel (compare the two as a ratio within one run).

On a CUDA GPU the shapes are serving-sized (bf16) and the timings mean something; add
``benchmarks/gpu/check_kernels.py`` for GB/s and TFLOP/s. Without one the kernels run in
Triton's interpreter (``TRITON_INTERPRET=1``, set per test) on tiny float32 shapes: that only
proves the benchmarks run -- interpreter timings say nothing about GPU speed.

Run: ``pytest benchmarks/test_kernels_bench.py --benchmark-only`` (add ``-k decode`` etc.).
"""
from __future__ import annotations

import pytest
import torch

from llmkit.kernels.activation import silu_and_mul, silu_and_mul_ref
from llmkit.kernels.cache import reshape_and_cache, reshape_and_cache_ref
from llmkit.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from llmkit.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref
from llmkit.kernels.rotary import rotary_embedding, rotary_embedding_ref
from helpers.kernel_inputs import make_paged_batch
from llmkit.kernels.unified import unified_attention, unified_attention_ref

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
# (GPU size, interpreter size)
S = (lambda gpu, cpu: gpu) if CUDA else (lambda gpu, cpu: cpu)
ROUNDS = 20 if CUDA else 1


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def run(benchmark, fn, *args, **kwargs):
    def call():
        out = fn(*args, **kwargs)
        if CUDA:
            torch.cuda.synchronize()
        return out

    call()  # compile / warm up
    return benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=0)


IMPLS = pytest.mark.parametrize("impl", ["triton", "torch"])


@pytest.mark.benchmark(group="reshape_and_cache")
@IMPLS
def test_reshape_and_cache(benchmark, impl):
    tokens, heads, dim, bs = S(4096, 16), S(8, 2), S(128, 32), 16
    blocks = tokens // bs + 1
    k = torch.randn(tokens, heads, dim, device=DEVICE, dtype=DTYPE)
    cache = torch.zeros(2, blocks, bs, heads, dim, device=DEVICE, dtype=DTYPE)
    slots = torch.randperm(blocks * bs, device=DEVICE)[:tokens]
    fn = reshape_and_cache if impl == "triton" else reshape_and_cache_ref
    run(benchmark, fn, k, k, cache, slots)


def _decode_batch(batch, ctx):
    return make_paged_batch([1] * batch, [ctx - 1] * batch, num_heads=S(32, 4),
                            num_kv_heads=S(8, 1), head_dim=S(128, 32), block_size=16,
                            dtype=DTYPE, device=DEVICE)


@pytest.mark.benchmark(group="paged_decode")
# The torch reference has no split over the KV length: one reference case, two kernel cases.
@pytest.mark.parametrize("impl,splits", [("triton", 1), ("triton", 4), ("torch", 1)])
def test_paged_decode(benchmark, impl, splits):
    q, cache, _, seq_lens, bt = _decode_batch(S(32, 2), S(4096, 40))
    if impl == "triton":
        run(benchmark, paged_decode_attention, q, cache, bt, seq_lens, 0.088,
            num_splits=splits)
    else:
        run(benchmark, paged_decode_attention_ref, q, cache, bt, seq_lens, 0.088)


@pytest.mark.benchmark(group="unified_attention")
@IMPLS
def test_unified_mixed_batch(benchmark, impl):
    q_lens = S([512, 256, 1, 1, 1, 1], [9, 1, 4])
    ctx = S([0, 1024, 2000, 3000, 100, 700], [0, 20, 5])
    q, cache, qsl, seq_lens, bt = make_paged_batch(
        q_lens, ctx, num_heads=S(32, 4), num_kv_heads=S(8, 1), head_dim=S(128, 32),
        block_size=16, dtype=DTYPE, device=DEVICE)
    fn = unified_attention if impl == "triton" else unified_attention_ref
    run(benchmark, fn, q, cache, qsl, seq_lens, bt, 0.088)


@pytest.mark.benchmark(group="fused_add_rms_norm")
@IMPLS
def test_fused_add_rms_norm(benchmark, impl):
    rows, hidden = S(4096, 4), S(4096, 64)
    x = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPE)
    res = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPE)
    w = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    fn = fused_add_rms_norm if impl == "triton" else fused_add_rms_norm_ref
    run(benchmark, fn, x, res, w, 1e-6)


@pytest.mark.benchmark(group="rotary_embedding")
@IMPLS
def test_rotary(benchmark, impl):
    tokens, heads, kv_heads, dim = S(4096, 4), S(32, 2), S(8, 1), S(128, 32)
    q = torch.randn(tokens, heads, dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(tokens, kv_heads, dim, device=DEVICE, dtype=DTYPE)
    cache = torch.randn(8192, dim, device=DEVICE, dtype=DTYPE)
    pos = torch.randint(0, 8192, (tokens,), device=DEVICE)
    fn = rotary_embedding if impl == "triton" else rotary_embedding_ref
    run(benchmark, fn, pos, q, k, cache, True)


@pytest.mark.benchmark(group="silu_and_mul")
@IMPLS
def test_silu_and_mul(benchmark, impl):
    x = torch.randn(S(4096, 4), 2 * S(14336, 64), device=DEVICE, dtype=DTYPE)
    fn = silu_and_mul if impl == "triton" else silu_and_mul_ref
    run(benchmark, fn, x)
