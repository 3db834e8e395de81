"""MLA attention over the paged latent cache (``llmkit/ops/mla.py``): the torch reference
against a naive dense per-request computation (float64, one query and head at a time), then
the platforms' kernels against the reference.

Small random shapes: H=4 heads, kv_lora_rank 32, rope 16, block sizes 4 and 16, ragged
context lengths, decode rows and prefill chunks (several causal queries after a cached
prefix) in one step. Each request's latent rows are written with ``write_latent_cache``
through a shuffled block table, so the reads exercise the table.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.config.cpu_isa import supported_tiers
from llmkit.config.errors import ConfigError
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.ops.base import ModelOps

H, RANK, ROPE = 4, 32, 16
DIM = RANK + ROPE


def make_step(q_lens: list[int], seq_lens: list[int], block_size: int, dtype: torch.dtype,
              seed: int, extra_rows: int = 0):
    """A step of requests with ``q_lens[i]`` query tokens ending at ``seq_lens[i]``: returns
    (q_latent, q_pe, latent_cache, metadata, dense latent rows per request). Every request's
    whole context is written (the prefix as earlier steps would have, this step's rows too)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(n / block_size) for n in seq_lens]
    total = sum(nblocks) + 3  # spare blocks: garbage the reads must not see
    perm = torch.randperm(total, generator=g)
    width = max(nblocks) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[at:at + nb].to(torch.int32)
        table[i, nb:] = perm[-1].item()  # past a row's length: any valid block
        at += nb
    cache = torch.randn(total, block_size, DIM, generator=g).to(dtype)
    ops = ModelOps()
    dense = []
    for i, n in enumerate(seq_lens):
        rows = torch.randn(n, DIM, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        ops.write_latent_cache(rows, cache, slots)
        dense.append(rows)
    t = sum(q_lens) + extra_rows
    q_latent = torch.randn(t, H, RANK, generator=g).to(dtype)
    q_pe = torch.randn(t, H, ROPE, generator=g).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    slot_mapping = torch.cat([
        table[i, torch.arange(n - q, n) // block_size].long() * block_size
        + torch.arange(n - q, n) % block_size for i, (q, n) in enumerate(zip(q_lens, seq_lens))])
    md = AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        slot_mapping=slot_mapping, query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
        block_size=block_size)
    return q_latent, q_pe, cache, md, dense


def naive(q_latent, q_pe, dense, q_lens, seq_lens, scale) -> torch.Tensor:
    """One query token and head at a time over the request's dense rows, float64."""
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    t = 0
    for rows, q_len, n in zip(dense, q_lens, seq_lens):
        rows = rows.double()
        c_kv, k_pe = rows[:, :RANK], rows[:, RANK:]
        for j in range(q_len):
            p = n - q_len + j
            for h in range(H):
                s = [scale * (float(q_latent[t, h].double() @ c_kv[x])
                              + float(q_pe[t, h].double() @ k_pe[x])) for x in range(p + 1)]
                m = max(s)
                w = torch.tensor([math.exp(v - m) for v in s], dtype=torch.float64)
                out[t, h] = (w / w.sum()) @ c_kv[:p + 1]
            t += 1
    return out


# (q_lens, seq_lens): decode rows only; prefill chunks after cached prefixes, whole prompts,
# and decode rows mixed in one step
STEPS = [
    ([1, 1, 1, 1], [1, 5, 16, 23]),
    ([3, 1, 7, 1], [3, 9, 20, 2]),
    ([5, 2], [5, 18]),
]
SCALE = (RANK + ROPE) ** -0.5 * 1.7


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("q_lens,seq_lens", STEPS)
def test_reference_matches_naive(block_size, q_lens, seq_lens):
    q_latent, q_pe, cache, md, dense = make_step(q_lens, seq_lens, block_size, torch.float32,
                                                 seed=block_size + sum(seq_lens), extra_rows=2)
    out = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    assert out.shape == (sum(q_lens) + 2, H, RANK) and out.dtype == torch.float32
    want = naive(q_latent, q_pe, dense, q_lens, seq_lens, SCALE)
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].double(), want[:n], rtol=1e-5, atol=1e-5)
    assert not out[n:].any()  # padding rows


@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_bf16_matches_naive(block_size):
    q_lens, seq_lens = [1, 4, 1], [13, 7, 30]
    q_latent, q_pe, cache, md, dense = make_step(q_lens, seq_lens, block_size, torch.bfloat16,
                                                 seed=7 * block_size)
    out = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    assert out.dtype == torch.bfloat16
    want = naive(q_latent, q_pe, dense, q_lens, seq_lens, SCALE)
    # float32 math on the same bf16 inputs: only the output's rounding to bf16 differs
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)


def test_decode_path_reads_tensors_only():
    """A step graph's decode metadata has no host copies: the decode-only path must not read
    them (and gives the per-request path's values)."""
    q_lens, seq_lens = [1, 1, 1], [6, 1, 11]
    q_latent, q_pe, cache, md, dense = make_step(q_lens, seq_lens, 4, torch.float32, seed=3)
    want = naive(q_latent, q_pe, dense, q_lens, seq_lens, SCALE)
    md.query_start_loc, md.query_start_loc_cpu, md.seq_lens_cpu = None, [], []
    out = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_write_latent_cache_skips_negative_slots():
    cache = torch.zeros(3, 4, DIM)
    latent = torch.randn(4, DIM)
    ModelOps().write_latent_cache(latent, cache, torch.tensor([5, -1, 0, 11]))
    flat = cache.view(-1, DIM)
    assert torch.equal(flat[5], latent[0]) and torch.equal(flat[0], latent[2])
    assert torch.equal(flat[11], latent[3])
    assert int((flat.abs().sum(-1) > 0).sum()) == 3


def test_quantized_latent_cache_refused():
    with pytest.raises(ConfigError, match="kv_cache.cache_dtype"):
        ModelOps().write_latent_cache(torch.randn(1, DIM), torch.zeros(1, 4, DIM,
                                                                       dtype=torch.int8),
                                      torch.tensor([0]))


# -- the C++ CPU kernel (kernels/cpu/mla_attention.h), every instruction-set tier ----------
DECODE_LENS = [1, 5, 16, 33, 70, 97]  # one row, whole blocks, past one and several 32-row tiles


@pytest.fixture(scope="module", params=supported_tiers())
def cpu_kernels(request):
    return load_cpu_kernels(request.param)


def decode_step(block_size, dtype, seed, lens=DECODE_LENS):
    return make_step([1] * len(lens), lens, block_size, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,table_dtype", [(4, torch.int32), (16, torch.int64)])
def test_cpu_kernel_matches_reference(cpu_kernels, dtype, block_size, table_dtype):
    q_latent, q_pe, cache, md, _ = decode_step(block_size, dtype, seed=block_size)
    want = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    out = cpu_kernels.mla_decode_attention(q_latent, q_pe, cache, md.block_table.to(table_dtype),
                                           md.seq_lens, SCALE)
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        # float32 sums in another order (tiles of 32 rows, an online softmax): rounding only
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    else:
        # the same float32 math on the same bf16 inputs; the outputs' rounding to bf16 may land
        # one step apart
        torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-5)
        assert (out == want).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_row_gives_its_bits_in_any_batch(cpu_kernels, dtype):
    """A sequence alone splits its heads over the threads; in a batch of 32 it is one task.
    Each head's arithmetic is the same either way, so the same bits."""
    lens = [(7 * i) % 90 + 1 for i in range(32)]
    q_latent, q_pe, cache, md, _ = decode_step(16, dtype, seed=11, lens=lens)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # a lone sequence's 4 heads: one per thread
    try:
        batched = cpu_kernels.mla_decode_attention(q_latent, q_pe, cache, md.block_table,
                                                   md.seq_lens, SCALE)
        for b in (0, 5, 31):
            alone = cpu_kernels.mla_decode_attention(
                q_latent[b:b + 1], q_pe[b:b + 1], cache, md.block_table[b:b + 1],
                md.seq_lens[b:b + 1], SCALE)
            assert torch.equal(alone, batched[b:b + 1]), b
        pair = cpu_kernels.mla_decode_attention(q_latent[3:5], q_pe[3:5], cache,
                                                md.block_table[3:5], md.seq_lens[3:5], SCALE)
        assert torch.equal(pair, batched[3:5])
    finally:
        torch.set_num_threads(threads)


def test_cpu_kernel_refuses_a_length_past_its_block_table(cpu_kernels):
    q_latent, q_pe, cache, md, _ = decode_step(4, torch.float32, seed=1, lens=[9])
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_kernels.mla_decode_attention(q_latent, q_pe, cache, md.block_table[:, :2],
                                         md.seq_lens, SCALE)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_cpu_write_latent_cache_matches_reference(cpu_kernels, slot_dtype):
    latent = torch.randn(6, DIM, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 0, -1, 9], dtype=slot_dtype)
    got, want = torch.zeros(5, 4, DIM, dtype=torch.bfloat16), torch.zeros(5, 4, DIM,
                                                                             dtype=torch.bfloat16)
    cpu_kernels.write_latent_cache(latent, got, slots)
    ModelOps().write_latent_cache(latent, want, slots.long())
    assert torch.equal(got, want)


def test_cpu_ops_run_decode_steps_in_the_kernel_and_chunks_in_the_reference(cpu_kernels):
    from llmkit.ops.cpu_ops import CpuNativeOps

    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(cpu_kernels, name)

    ops = CpuNativeOps(Counting())
    q_latent, q_pe, cache, md, _ = make_step([1, 1, 1], [9, 1, 40], 4, torch.float32, seed=2,
                                             extra_rows=2)
    out = ops.mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    assert calls == ["mla_decode_attention"]
    torch.testing.assert_close(out, ModelOps().mla_decode_attention(q_latent, q_pe, cache, md,
                                                                     SCALE),
                               rtol=1e-5, atol=1e-6)
    assert not out[3:].any()
    calls.clear()
    q_latent, q_pe, cache, md, _ = make_step([3, 1], [9, 4], 4, torch.float32, seed=2)
    out = ops.mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    assert calls == []  # a prefill chunk: the reference's bits
    assert torch.equal(out, ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE))


# -- the Triton kernel (kernels/mla_attention.py), in Triton's interpreter without a GPU ----
@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("block_size,num_splits", [(4, 1), (16, 1), (4, 3), (16, 2)])
def test_triton_kernel_matches_reference(interpret, block_size, num_splits):
    from llmkit.kernels import count_launches
    from llmkit.kernels.mla_attention import mla_decode_attention, mla_decode_attention_ref

    q_latent, q_pe, cache, md, _ = decode_step(block_size, torch.float32, seed=block_size + 1)
    want = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    dev = interpret
    with count_launches() as launches:
        out = mla_decode_attention(q_latent.to(dev), q_pe.to(dev), cache.to(dev),
                                   md.block_table.to(dev), md.seq_lens.to(dev), SCALE,
                                   num_splits=num_splits)
    assert launches["_mla_decode_kernel"] == 1
    assert launches["_decode_reduce_kernel"] == (num_splits > 1)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        mla_decode_attention_ref(q_latent, q_pe, cache, md.block_table, md.seq_lens, SCALE),
        want, rtol=1e-5, atol=1e-6)


def test_triton_ops_write_and_decode_steps(interpret):
    from llmkit.kernels import count_launches
    from llmkit.ops.triton_ops import TritonOps

    dev = interpret
    ops = TritonOps()
    latent = torch.randn(5, DIM).to(dev)
    slots = torch.tensor([6, -1, 0, 13, -1]).to(dev)
    got, want = torch.zeros(4, 4, DIM).to(dev), torch.zeros(4, 4, DIM).to(dev)
    with count_launches() as launches:
        ops.write_latent_cache(latent, got, slots)
    ModelOps().write_latent_cache(latent, want, slots)
    assert launches["_write_latent_kernel"] == 1 and torch.equal(got, want)

    q_latent, q_pe, cache, md, _ = make_step([1, 1, 1], [9, 1, 40], 4, torch.float32, seed=4,
                                             extra_rows=1)
    want = ModelOps().mla_decode_attention(q_latent, q_pe, cache, md, SCALE)
    with count_launches() as launches:
        out = ops.mla_decode_attention(q_latent.to(dev), q_pe.to(dev), cache.to(dev), md, SCALE)
    assert launches["_mla_decode_kernel"] == 1
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not out[3:].any()
    # the step's tables moved once, kept for the other layers (AttentionMetadata.derived); a
    # metadata made from this one (a KV group's, by dataclasses.replace) starts without them
    assert [k[0] for k in md.derived] == ["mla_tables"]
    assert dataclasses.replace(md).derived == {}
    # a prefill chunk: the reference
    q_latent, q_pe, cache, md, _ = make_step([3, 1], [9, 4], 4, torch.float32, seed=5)
    with count_launches() as launches:
        out = ops.mla_decode_attention(q_latent.to(dev), q_pe.to(dev), cache.to(dev), md, SCALE)
    assert launches["_mla_decode_kernel"] == 0
    torch.testing.assert_close(out.cpu(), ModelOps().mla_decode_attention(q_latent, q_pe, cache,
                                                                          md, SCALE))


def test_triton_write_reference_matches_the_ops_reference():
    from llmkit.kernels.mla_attention import write_latent_cache_ref

    latent, slots = torch.randn(4, DIM), torch.tensor([2, -1, 7, 0])
    got, want = torch.zeros(2, 4, DIM), torch.zeros(2, 4, DIM)
    write_latent_cache_ref(latent, got, slots)
    ModelOps().write_latent_cache(latent, want, slots)
    assert torch.equal(got, want)
