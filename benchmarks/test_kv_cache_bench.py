"""KV cache microbenchmarks: the block pool and prefix lookups under each eviction policy.

- ``pool_alloc_free_empty``: take N empty blocks and give them back (no policy involved).
- ``pool_evict_cycle``: every free block is cached; take N (evicting them through the policy),
  register new content, free them tail first, then hit every 8th block once (so lfu has two
  hit counts to order). The policy's add / remove / pop are all on this path.
- ``lookup_full_hit_1024``: ``get_computed_blocks`` on a fresh request whose 1,024-token prompt
  is fully cached (63 blocks of 16; the last token is always recomputed). Hashing included:
  every new request hashes its prompt once.
- ``lookup_full_hit_1024_hashed``: the same request again (a re-admission after preemption):
  hashes known, table lookups only.
- ``admit_free_full_hit_1024``: lookup + ``allocate_slots`` (touches 63 cached free blocks,
  taking them out of the policy) + ``free`` (gives them back): the policy's hit path.

Compare figures as ratios within one run (lru vs lfu), never as absolute times.
Run: ``pytest benchmarks/test_kv_cache_bench.py --benchmark-only``.
"""
from __future__ import annotations

import pytest

from llmkit.kv_cache import BlockPool, KVCacheManager, make_eviction_policy
from llmkit.request import Request
from llmkit.sampling import SamplingParams

POLICIES = ["lru", "lfu"]
N = 256
BLOCK_SIZE = 16
PROMPT = [(31 * t + 7) % 32000 for t in range(1024)]


@pytest.mark.benchmark(group="kv-pool-empty")
@pytest.mark.parametrize("policy", POLICIES)
def test_pool_alloc_free_empty(benchmark, policy):
    pool = BlockPool(4 * N, enable_caching=True, eviction_policy=make_eviction_policy(policy))

    def cycle():
        blocks = pool.get_new_blocks(N)
        pool.free_blocks(reversed(blocks))

    benchmark(cycle)
    assert pool.num_free_blocks == 4 * N


@pytest.mark.benchmark(group="kv-pool-evict")
@pytest.mark.parametrize("policy", POLICIES)
def test_pool_evict_cycle(benchmark, policy):
    pool = BlockPool(N, enable_caching=True, eviction_policy=make_eviction_policy(policy))
    counter = iter(range(1 << 62))

    def fill_and_free():
        blocks = pool.get_new_blocks(N)
        gen = next(counter)
        hashes = [gen.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(N)]
        pool.cache_full_blocks(blocks, hashes, 0, N)
        pool.free_blocks(reversed(blocks))
        hot = blocks[::8]
        pool.touch(hot)
        pool.free_blocks(hot)

    fill_and_free()  # from here on every free block is cached: each cycle evicts N
    benchmark(fill_and_free)
    assert pool.num_free_blocks == N and pool.num_evictions >= N


def _warm_manager(policy: str) -> KVCacheManager:
    m = KVCacheManager(256, BLOCK_SIZE, eviction_policy=policy)
    first = Request("warm", PROMPT, SamplingParams())
    hits, n = m.get_computed_blocks(first)
    assert m.allocate_slots(first, len(PROMPT), new_computed_blocks=hits,
                            num_new_computed_tokens=n) is not None
    m.free(first)
    return m


@pytest.mark.benchmark(group="kv-lookup-1024")
@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_full_hit_1024(benchmark, policy):
    m = _warm_manager(policy)
    ids = iter(range(1 << 62))

    def setup():
        return (Request(f"r{next(ids)}", PROMPT, SamplingParams()),), {}

    hits, n = benchmark.pedantic(m.get_computed_blocks, setup=setup, rounds=300, iterations=1,
                                 warmup_rounds=10)
    assert n == 1008 and len(hits) == 63


@pytest.mark.benchmark(group="kv-lookup-1024-hashed")
@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_full_hit_1024_hashed(benchmark, policy):
    m = _warm_manager(policy)
    req = Request("again", PROMPT, SamplingParams())
    m.get_computed_blocks(req)  # hashes the prompt once
    hits, n = benchmark(m.get_computed_blocks, req)
    assert n == 1008 and len(hits) == 63


@pytest.mark.benchmark(group="kv-admit-free-1024")
@pytest.mark.parametrize("policy", POLICIES)
def test_admit_free_full_hit_1024(benchmark, policy):
    m = _warm_manager(policy)
    req = Request("again", PROMPT, SamplingParams())
    m.get_computed_blocks(req)

    def admit_and_free():
        hits, n = m.get_computed_blocks(req)
        m.allocate_slots(req, len(PROMPT) - n, new_computed_blocks=hits,
                         num_new_computed_tokens=n)
        m.free(req)
        return n

    assert benchmark(admit_and_free) == 1008
    m.check_integrity()
