"""Attention kernels of llmkit.kernels against their torch references: reshape_and_cache, paged
decode attention (with and without the flash-decoding split + reduce) and unified varlen
attention over mixed batches -- block sizes 16 and 32, GQA ratios 1, 4 and 8, ragged lengths.

Without CUDA they run in Triton's interpreter: the ``interpret`` fixture sets
``TRITON_INTERPRET=1`` for each test (llmkit's kernels decide compiled vs interpreted at launch
time, so the import order of triton in this process does not matter). float32, small shapes.
"""
from __future__ import annotations

import pytest
import torch

from llmkit.kernels import count_launches
from llmkit.kernels.cache import reshape_and_cache, reshape_and_cache_ref
from llmkit.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from helpers.kernel_inputs import make_paged_batch, tolerances
from llmkit.kernels.unified import (choose_block_q, unified_attention,
                                              unified_attention_ref, unified_attention_tiles)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32 = tolerances(torch.float32)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE.type != "cuda":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ------------------------------------------------------------------------ reshape_and_cache

@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [
    (16, 1, 64), (32, 2, 128), (16, 4, 80), (32, 8, 96),
])
def test_reshape_and_cache(block_size, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(block_size + head_dim)
    num_tokens, num_blocks = 21, 5
    # K and V as views of a fused qkv projection: token stride != heads * head_dim.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g).to(DEVICE)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7, 20]] = -1  # padding tokens: not written
    slots = slots.to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    expected = cache.clone()
    with count_launches() as launches:
        reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_ref(k, v, expected, slots)
    assert launches["_reshape_and_cache_kernel"] == 1
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------ paged decode

# (block_size, num_kv_heads, queries per KV head, head_dim, num_splits)
DECODE_CASES = [
    (16, 2, 1, 64, 1),
    (16, 1, 4, 128, 3),
    (16, 1, 8, 64, 2),
    (32, 2, 1, 128, 2),
    (32, 1, 4, 64, 1),
    (32, 1, 8, 64, 4),
    (16, 2, 2, 80, 2),
    (32, 1, 3, 96, 1),
]


@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim,num_splits", DECODE_CASES)
def test_paged_decode_attention(block_size, num_kv_heads, group, head_dim, num_splits):
    # Ragged context lengths, none a multiple of the block size but one; 1 token alone (its
    # later splits are empty and must weigh nothing in the reduce).
    seq_lens = [1, 37, 2 * block_size, 70]
    q, cache, _, seq_lens_t, block_table = make_paged_batch(
        [1] * len(seq_lens), [n - 1 for n in seq_lens], num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, device=DEVICE,
        seed=head_dim + group)
    scale = head_dim ** -0.5
    with count_launches() as launches:
        out = paged_decode_attention(q, cache, block_table, seq_lens_t, scale,
                                     num_splits=num_splits, block_n=32)
    expected = paged_decode_attention_ref(q, cache, block_table, seq_lens_t, scale)
    torch.testing.assert_close(out, expected, **F32)
    assert launches["_paged_decode_kernel"] == 1
    assert launches["_decode_reduce_kernel"] == (1 if num_splits > 1 else 0)


def test_paged_decode_splits_agree():
    """Splitting the KV length changes the order of the sums, not the result."""
    q, cache, _, seq_lens, block_table = make_paged_batch(
        [1, 1], [150, 93], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        device=DEVICE, seed=3)
    one = paged_decode_attention(q, cache, block_table, seq_lens, 0.125, num_splits=1)
    five = paged_decode_attention(q, cache, block_table, seq_lens, 0.125, num_splits=5)
    torch.testing.assert_close(one, five, **F32)


# ------------------------------------------------------------------------ unified varlen

# (block_size, num_kv_heads, queries per KV head, head_dim)
UNIFIED_CASES = [
    (16, 2, 1, 64),
    (16, 1, 4, 64),
    (16, 1, 8, 128),
    (32, 2, 1, 128),
    (32, 1, 4, 64),
    (32, 1, 8, 64),
    (16, 1, 2, 80),
    (32, 1, 3, 96),
]


@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim", UNIFIED_CASES)
def test_unified_attention_mixed_batch(block_size, num_kv_heads, group, head_dim):
    # decode, fresh prefill, chunked prefill (cached prefix + a chunk), decode, short chunk
    q_lens = [1, 19, 11, 1, 3]
    ctx_lens = [40, 0, 21, 5, block_size]
    q, cache, qsl, seq_lens, block_table = make_paged_batch(
        q_lens, ctx_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, device=DEVICE, seed=head_dim * group)
    scale = head_dim ** -0.5
    with count_launches() as launches:
        out = unified_attention(q, cache, qsl, seq_lens, block_table, scale, block_n=32)
    expected = unified_attention_ref(q, cache, qsl, seq_lens, block_table, scale)
    torch.testing.assert_close(out, expected, **F32)
    assert launches["_unified_attention_kernel"] == 1


@pytest.mark.parametrize("block_q", [1, 4])
def test_unified_attention_tile_map_and_empty_request(block_q):
    """A given tile map (built once per step by the backend) and a request with no new tokens
    this step; several tiles per request."""
    q_lens, ctx_lens = [5, 0, 9], [3, 12, 0]
    q, cache, qsl, seq_lens, block_table = make_paged_batch(
        q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        device=DEVICE, seed=11)
    tile_seq, tile_qoff = unified_attention_tiles(qsl.tolist(), block_q, DEVICE)
    assert tile_seq.tolist() == [0] * -(-5 // block_q) + [2] * -(-9 // block_q)
    out = unified_attention(q, cache, qsl, seq_lens, block_table, 0.125,
                            tiles=(tile_seq, tile_qoff, block_q))
    torch.testing.assert_close(out, unified_attention_ref(q, cache, qsl, seq_lens, block_table,
                                                          0.125), **F32)


def test_unified_equals_decode_kernel_on_decodes():
    q, cache, qsl, seq_lens, block_table = make_paged_batch(
        [1, 1, 1], [8, 33, 64], num_heads=8, num_kv_heads=2, head_dim=64, block_size=32,
        device=DEVICE, seed=5)
    a = unified_attention(q, cache, qsl, seq_lens, block_table, 0.125)
    b = paged_decode_attention(q, cache, block_table, seq_lens, 0.125, num_splits=2)
    torch.testing.assert_close(a, b, **F32)


def test_choose_block_q():
    assert choose_block_q(1, 1) == 16 and choose_block_q(1, 8) == 2
    assert choose_block_q(512, 1) == 64 and choose_block_q(512, 4) == 16
    assert choose_block_q(512, 3) == 16  # 3 query heads padded to 4 rows
