"""The C++ decode attention's rows that share a context (a speculative verify step's 1 + K
rows of one sequence: the same block-table row, lengths L - K .. L) read its K/V once for all
of them; each row must still get the bits the kernel gives it alone (a row's bits must not
depend on its batch), on every instruction-set tier and cache format, with a window and a soft
cap, at empty, tail, multi-block and past-one-SDPA-block lengths."""
from __future__ import annotations

import contextlib

import pytest
import torch

from llmkit.config.cpu_isa import supported_tiers
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.kv_quant import FORMATS, quantize_rows


@pytest.fixture(scope="module", params=supported_tiers())
def ops(request):
    return load_cpu_kernels(request.param)


@contextlib.contextmanager
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_cache(kind, blocks, block_size, kv_heads, dim):
    x = randn(2, blocks, block_size, kv_heads, dim, seed=dim + kv_heads)
    if kind in FORMATS:
        x = x * torch.rand(2, blocks, block_size, kv_heads, 1,
                           generator=torch.Generator().manual_seed(1)) * 4
        return quantize_rows(x, FORMATS[kind])
    return x.to(getattr(torch, kind))


# Runs of rows as the CPU backend's verify rows give them: (table row, lengths). A run whose
# lengths start at 0 (empty rows), tails past tiles of 16 and pairs, a block boundary crossed
# inside the run, many blocks, past SDPA's 512-row block, unequal steps; a lone row; and two
# rows whose tables differ in a block the shorter one reads (they must not share a read).
RUNS = [(0, [0, 1, 2, 3, 4, 5]), (1, [32, 33, 34, 35, 36, 37]), (2, [295, 296, 297, 298, 299, 300]),
        (3, [17]), (4, [3, 3, 40, 41, 90]), (5, [528, 529, 530, 531, 532, 533]),
        (6, [20]), (7, [21])]


def batch_of(runs, table_rows):
    rows = [(t, n) for t, lens in runs for n in lens]
    table = torch.stack([table_rows[t] for t, _ in rows])
    return table, torch.tensor([n for _, n in rows], dtype=torch.int32)


@pytest.mark.parametrize("qdtype,kind", [
    (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),  # read in place
    (torch.bfloat16, "int8"), (torch.float32, "fp8_e4m3"), (torch.float32, "bfloat16")])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (64, 8, 1), (128, 4, 4), (80, 4, 2)])
def test_rows_sharing_a_context_give_their_bits_alone(ops, qdtype, kind, dim, heads, kv_heads):
    blocks, block_size = 48, 16
    perms = [torch.randperm(blocks, generator=torch.Generator().manual_seed(i))[:34]
             for i in range(8)]
    perms[7] = perms[6].clone()
    perms[7][1] = (perms[6][1] + 1) % blocks  # same first block, another second block
    table = torch.stack(perms).to(torch.int32)
    cache = make_cache(kind, blocks, block_size, kv_heads, dim)
    bt, lens = batch_of(RUNS, table)
    q = randn(len(lens), heads, dim, seed=3).to(qdtype)
    for window, cap in ((0, 0.0), (37, 0.0), (300, 0.0), (0, 30.0)):
        out = ops.paged_decode_attention(q, cache, bt, lens, 0.125, window, cap)
        # each row alone on one thread (which thread runs a task changes no bit; one row at
        # a time on two threads waits on a busy machine's scheduler)
        with single_thread():
            for i in range(len(lens)):
                alone = ops.paged_decode_attention(q[i:i + 1], cache, bt[i:i + 1],
                                                   lens[i:i + 1], 0.125, window, cap)
                assert torch.equal(out[i:i + 1], alone), (window, cap, i, int(lens[i]))
        # one run alone, as a batch-1 verify step gives it (few tasks: split per query head
        # or per part of the run's rows)
        at = 0
        for _, run_lens in RUNS:
            n = len(run_lens)
            one = ops.paged_decode_attention(q[at:at + n], cache, bt[at:at + n],
                                             lens[at:at + n], 0.125, window, cap)
            assert torch.equal(one, out[at:at + n]), (window, cap, run_lens)
            at += n
