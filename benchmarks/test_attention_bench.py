"""Attention backends (``llmkit.attention``) on one layer of a paged KV cache: the per-step
``build_metadata`` and the per-layer ``forward`` (which also writes the new K/V), on a decode
batch, a prefill batch and a mixed chunked-prefill batch.

On the CPU only the ``torch`` backend runs (the ``triton`` one needs a GPU; its kernels have
their own interpreter benchmarks in test_kernels_bench.py); on a GPU both run, in one group per
case, so they compare as a ratio. Shapes: 8 query heads, 2 KV heads, head_dim 64, block 16
(CPU); 32 / 8 / 128 in bf16 on a GPU.

Run: ``pytest benchmarks/test_attention_bench.py --benchmark-only``.
"""
from __future__ import annotations

import pytest
import torch

from llmkit.attention import ATTENTION_BACKENDS
from llmkit.attention.base import AttentionMetadata
from helpers.kernel_inputs import make_paged_batch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
HEADS, KV_HEADS, DIM = (32, 8, 128) if CUDA else (8, 2, 64)
BLOCK = 16
SCALE = 1 / DIM ** 0.5

# (new tokens per request, cached tokens per request)
CASES = {
    "decode_32x1024": ([1] * 32, [1023] * 32) if not CUDA else ([1] * 256, [2047] * 256),
    "prefill_2x512": ([512] * 2, [0] * 2) if not CUDA else ([2048] * 4, [0] * 4),
    "mixed_256+16d": ([256] + [1] * 16, [256] + [511] * 16) if not CUDA
    else ([1024] + [1] * 128, [1024] + [2047] * 128),
}
BACKENDS = ["torch", "triton"]


def make_step(q_lens, ctx_lens):
    """q/k/v and the cache on the device; the step's metadata on the CPU, as
    ``ModelRunner.prepare_inputs`` hands it to ``build_metadata``."""
    q, cache, qsl, seq_lens, table = make_paged_batch(
        q_lens, ctx_lens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        block_size=BLOCK, dtype=DTYPE, device="cpu")
    q, cache = q.to(DEVICE), cache.to(DEVICE)
    n = q.shape[0]
    g = torch.Generator().manual_seed(2)
    k = torch.randn(n, KV_HEADS, DIM, generator=g).to(DEVICE, DTYPE)
    v = torch.randn(n, KV_HEADS, DIM, generator=g).to(DEVICE, DTYPE)
    slots = []
    for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(cl, cl + ql):
            slots.append(int(table[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
    qsl_cpu, seq_cpu = qsl.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=n, max_query_len=max(q_lens),
        max_seq_len=max(seq_cpu), query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, block_size=BLOCK)
    return q, k, v, cache, meta


def backend_or_skip(name: str):
    if name == "triton" and not CUDA:
        pytest.skip("the triton backend needs a GPU (its kernels: test_kernels_bench.py)")
    return ATTENTION_BACKENDS.resolve(name, None)()


def sync(out):
    if CUDA:
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_forward(benchmark, backend, case):
    benchmark.group = f"attention forward: {case}"
    be = backend_or_skip(backend)
    q, k, v, cache, meta = make_step(*CASES[case])
    meta = be.build_metadata(meta)
    with torch.inference_mode():
        sync(be.forward(q, k, v, cache, meta, SCALE))  # warm up (and compile, on a GPU)
        out = benchmark(lambda: sync(be.forward(q, k, v, cache, meta, SCALE)))
    assert out.shape == q.shape
    benchmark.extra_info.update(tokens=q.shape[0], reqs=meta.num_reqs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_build_metadata(benchmark, backend, case):
    benchmark.group = f"attention build_metadata: {case}"
    be = backend_or_skip(backend)
    *_, meta = make_step(*CASES[case])
    benchmark(lambda: sync(be.build_metadata(meta)))
