"""Random inputs for checking kernels against their references, and the tolerances (the tests
under ``TRITON_INTERPRET=1``, the kernel benchmarks, ``benchmarks/gpu/check_kernels.py`` on a
GPU).

The interpreter is slow and its bf16 arithmetic is not the GPU's: CPU tests use float32 and
small shapes; GPU checks use bf16 too.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def tolerances(dtype: torch.dtype) -> dict:
    """``torch.testing.assert_close`` tolerances for a kernel vs its float32-math reference."""
    if dtype == torch.float32:
        return {"atol": 5e-5, "rtol": 1e-4}
    return {"atol": 3e-2, "rtol": 3e-2}


def make_paged_batch(q_lens: Sequence[int], ctx_lens: Sequence[int], *, num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     seed: int = 0, extra_blocks: int = 3):
    """A random KV cache and a batch whose requests own shuffled, non-contiguous blocks.

    Request i has ``ctx_lens[i]`` cached tokens and ``q_lens[i]`` new ones (their K/V already in
    the cache, as after ``reshape_and_cache``). Returns ``(q, kv_cache, query_start_loc,
    seq_lens, block_table)``; ``q`` is ``[sum(q_lens), num_heads, head_dim]``, the cache
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_per_req = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # a padding column the kernels must not read
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return (q.to(device, dtype), kv_cache.to(device, dtype),
            torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table.to(device))
