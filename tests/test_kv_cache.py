"""Paged KV cache manager: block pool, LRU free queue, prefix caching, hashing, integrity."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmkit.kv_cache import (
    KV_CACHE_MANAGERS,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    LRUEvictionPolicy,
    PrefixCacheStats,
    hash_block_tokens,
)
from llmkit.kv_cache import hashing as hashing_mod
from llmkit.kv_cache.base import KVCacheIntegrityError, KVCacheManagerBase
from llmkit.request import Request
from llmkit.sampling.params import SamplingParams


def make_req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), **kw)


def admit(m: KVCacheManager, req: Request, num_new_tokens: int | None = None,
          lookahead: int = 0):
    """What the scheduler does for a waiting request: look up hits, then allocate the rest."""
    hits, n_hit = m.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - req.num_computed_tokens - n_hit
    new = m.allocate_slots(req, num_new_tokens, lookahead, new_computed_blocks=hits,
                           num_new_computed_tokens=n_hit)
    if new is not None:
        req.num_computed_tokens += n_hit
    return hits, n_hit, new


def run_step(req: Request, num_new_tokens: int) -> None:
    """The model computed ``num_new_tokens`` more tokens."""
    req.num_computed_tokens += num_new_tokens


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.iter_free_blocks()]


def snapshot(m: KVCacheManager) -> tuple:
    pool = m.block_pool
    return (
        free_ids(m),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {rid: [b.block_id for b in bl] for rid, bl in m.req_to_blocks.items()},
        dict(m.num_cached_blocks),
        m.num_free_blocks,
    )


# -- FreeBlockQueue -----------------------------------------------------------------------
def test_free_queue_order_and_o1_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4, 5] and q.num_free_blocks == 6

    q.remove(blocks[3])  # from the middle
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert blocks[2].next_free is blocks[4] and blocks[4].prev_free is blocks[2]
    assert [b.block_id for b in q] == [0, 1, 2, 4, 5] and len(q) == 5

    q.remove(blocks[0])  # the head
    q.remove(blocks[5])  # the tail
    assert [b.block_id for b in q] == [1, 2, 4]

    assert q.popleft() is blocks[1]
    q.append(blocks[3])
    q.append_n([blocks[0], blocks[5]])
    assert [b.block_id for b in q] == [2, 4, 3, 0, 5]
    assert [b.block_id for b in q.popleft_n(3)] == [2, 4, 3]
    assert [b.block_id for b in q] == [0, 5] and q.num_free_blocks == 2
    q.appendleft_n([blocks[2], blocks[4]])
    assert [b.block_id for b in q] == [2, 4, 0, 5]
    assert q.popleft_n(0) == []

    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not in the queue
    with pytest.raises(ValueError):
        q.popleft_n(5)
    assert [b.block_id for b in q.popleft_n(4)] == [2, 4, 0, 5]
    with pytest.raises(ValueError):
        q.popleft()
    assert list(q) == [] and q.num_free_blocks == 0
    q.append(blocks[1])
    assert [b.block_id for b in q] == [1]


def test_block_pool_basics():
    pool = BlockPool(4, enable_caching=True, eviction_policy=LRUEvictionPolicy())
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2] and all(b.ref_cnt == 1 for b in got)
    assert pool.usage == pytest.approx(0.75) and pool.num_free_blocks == 1
    pool.cache_full_blocks(got, [b"h0", b"h1"], 0, 2)
    assert pool.get_cached_block(b"h0") is got[0] and got[0].block_hash == b"h0"
    # A second block with an already cached hash stays uncached.
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks(other, [b"h0"], 0, 1)
    assert other[0].block_hash is None and pool.get_cached_block(b"h0") is got[0]
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(got + other))
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    # Uncached blocks are reused first, then cached ones from the tail of the last request.
    assert [b.block_id for b in pool.iter_free_blocks()] == [3, 2, 1, 0]
    pool.touch([got[1]])
    assert got[1].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([got[1]])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)


# -- allocation / free ----------------------------------------------------------------------
def test_allocate_and_free_return_every_block():
    m = KVCacheManager(num_blocks=32, block_size=4)
    assert m.num_free_blocks == 32 and m.usage == 0.0
    reqs = [make_req(f"r{i}", [i * 100 + t for t in range(5 + 3 * i)]) for i in range(5)]
    for r in reqs:
        _, _, new = admit(m, r)
        assert new is not None
        assert len(m.get_block_ids(r.request_id)) == -(-r.num_tokens // 4)
        run_step(r, r.num_tokens - r.num_computed_tokens)
    m.check_integrity()
    # a few decode steps
    for step in range(6):
        for r in reqs:
            r.append_output_token(7 + step)
            assert m.allocate_slots(r, 1) is not None
            run_step(r, 1)
            assert len(m.get_block_ids(r.request_id)) == -(-r.num_tokens // 4)
        m.check_integrity()
    used = sum(len(m.get_block_ids(r.request_id)) for r in reqs)
    assert m.num_free_blocks == 32 - used
    assert m.usage == pytest.approx(used / 32)
    for r in reqs:
        m.free(r)
        m.free(r)  # twice is harmless
        m.check_integrity()
    assert m.num_free_blocks == 32 and m.usage == 0.0
    assert m.get_block_ids("r0") == [] and m.get_blocks("r0") == []


def test_allocate_returns_only_new_blocks_and_none_when_nothing_needed():
    m = KVCacheManager(num_blocks=8, block_size=4)
    r = make_req("a", list(range(6)))
    new = m.allocate_slots(r, 6)
    assert [b.block_id for b in new] == [0, 1]
    run_step(r, 6)
    r.append_output_token(99)
    assert m.allocate_slots(r, 1) == []  # 7 tokens still fit in 2 blocks
    run_step(r, 1)
    r.append_output_token(98)
    assert m.allocate_slots(r, 1) == []  # 8 tokens: exactly 2 blocks
    run_step(r, 1)
    r.append_output_token(97)
    new = m.allocate_slots(r, 1)  # the 9th token needs a 3rd block
    assert [b.block_id for b in new] == [2]
    assert m.get_block_ids("a") == [0, 1, 2]


def test_out_of_blocks_returns_none_and_changes_nothing():
    m = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", list(range(12)))
    admit(m, a)
    run_step(a, 12)
    m.free(a)  # 3 cached blocks (ids 0..2) are free, at the tail; 3 never used at the head
    held = make_req("held", list(range(1000, 1008)))
    assert admit(m, held)[2] is not None  # takes the 2 uncached at the head
    # b hits a's 3 cached blocks, all with ref_cnt 0: touching them takes them
    # out of the free queue, leaving 1 free block; b needs 3 + 2 = 5 blocks -> 2 new.
    b = make_req("b", list(range(12)) + [5, 6, 7, 8, 9, 10, 11, 12])
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 12 and [x.block_id for x in hits] == [0, 1, 2]
    assert m.num_free_blocks == 4  # enough if the hits were not counted
    before = snapshot(m)
    hashes_before = list(b.block_hashes)
    assert m.allocate_slots(b, 8, new_computed_blocks=hits, num_new_computed_tokens=n_hit) is None
    assert snapshot(m) == before and b.block_hashes == hashes_before
    assert "b" not in m.req_to_blocks
    m.check_integrity()
    # Plain out-of-blocks for a running request, too.
    assert m.allocate_slots(held, 4 * 7) is None  # 7 blocks > 2 held + 4 free
    assert snapshot(m) == before
    # After room is made, the same call succeeds.
    m.free(held)
    new = m.allocate_slots(b, 8, new_computed_blocks=hits, num_new_computed_tokens=n_hit)
    assert new is not None and len(new) == 2
    assert m.get_block_ids("b")[:3] == [0, 1, 2]
    m.check_integrity()


# -- LRU eviction --------------------------------------------------------------------------
def test_lru_eviction_order_tail_blocks_first_then_older_requests():
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(12)))        # 3 full blocks
    b = make_req("b", list(range(100, 112)))  # 3 full blocks
    admit(m, a)
    admit(m, b)
    ids_a, ids_b = m.get_block_ids("a"), m.get_block_ids("b")
    assert ids_a == [0, 1, 2] and ids_b == [3, 4, 5]
    m.free(a)
    m.free(b)
    m.check_integrity()
    # never-used blocks first, then a's tail .. a's head, then b's tail .. b's head
    assert free_ids(m) == [6, 7, 8, 9, 2, 1, 0, 5, 4, 3]

    # Allocating 6 blocks evicts a's last two blocks, keeps a's first block cached.
    c = make_req("c", list(range(500, 524)))
    new = m.allocate_slots(c, 24)
    assert [x.block_id for x in new] == [6, 7, 8, 9, 2, 1]
    a2 = make_req("a2", list(range(12)) + [1])
    hits, n = m.get_computed_blocks(a2)
    assert [x.block_id for x in hits] == [0] and n == 4
    b2 = make_req("b2", list(range(100, 112)) + [1])
    hits, n = m.get_computed_blocks(b2)
    assert [x.block_id for x in hits] == [3, 4, 5] and n == 12
    m.check_integrity()


def test_freed_cached_blocks_are_hits_until_evicted():
    m = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks, all shareable (12 // 4)
    a = make_req("a", prompt)
    admit(m, a)
    m.free(a)
    for i in range(3):  # hit again and again while nothing evicts them
        r = make_req(f"again{i}", prompt)
        hits, n, new = admit(m, r)
        assert n == 12 and [x.block_id for x in hits] == [0, 1, 2]
        assert len(new) == 1
        m.free(r)
        m.check_integrity()
    # Fill the whole pool with other content: every cached block is evicted.
    filler = make_req("filler", list(range(900, 924)))
    assert admit(m, filler)[2] is not None
    assert m.num_free_blocks == 0
    m.free(filler)
    r = make_req("late", prompt)
    hits, n = m.get_computed_blocks(r)
    assert hits == [] and n == 0
    m.check_integrity()


# -- prefix hits ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens", [32, 40])
def test_identical_prompts_share_n_minus_1_over_block_size_blocks(n_tokens):
    bs = 16
    m = KVCacheManager(num_blocks=16, block_size=bs)
    prompt = [(7 * t + 3) % 1000 for t in range(n_tokens)]
    a, b = make_req("a", prompt), make_req("b", prompt)
    hits, n, _ = admit(m, a)
    assert hits == [] and n == 0
    run_step(a, n_tokens)
    hits, n, new = admit(m, b)
    expected = (n_tokens - 1) // bs
    assert len(hits) == expected and n == expected * bs
    assert b.num_computed_tokens == expected * bs
    ids_a, ids_b = m.get_block_ids("a"), m.get_block_ids("b")
    assert ids_a[:expected] == ids_b[:expected]
    assert set(ids_a[expected:]).isdisjoint(ids_b[expected:])
    assert len(ids_b) == -(-n_tokens // bs)
    for blk in m.get_blocks("a")[:expected]:
        assert blk.ref_cnt == 2
    assert a.block_hashes[: n_tokens // bs] == b.block_hashes[: n_tokens // bs]
    m.check_integrity()
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 16
    m.check_integrity()


def test_shared_prefix_then_divergence_shares_only_the_prefix():
    m = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", list(range(12)) + [1, 2, 3, 4, 5])
    b = make_req("b", list(range(8)) + [50, 51, 52, 53, 1, 2, 3, 4, 5])
    admit(m, a)
    hits, n, _ = admit(m, b)
    assert n == 8 and [x.block_id for x in hits] == m.get_block_ids("a")[:2]
    # b's 4th block has a's 4th block's tokens but a different parent: not shared.
    assert a.block_hashes[3] != b.block_hashes[3]
    m.check_integrity()


def test_extra_keys_separate_the_caches():
    prompt = list(range(40))
    variants = [
        {}, {"cache_salt": "alice"}, {"cache_salt": "bob"}, {"lora_id": 1}, {"lora_id": 2},
        {"mm_hashes": ("img0",)},
    ]
    m = KVCacheManager(num_blocks=64, block_size=8)
    for i, kw in enumerate(variants):
        r = make_req(f"r{i}", prompt, **kw)
        hits, n, _ = admit(m, r)
        assert hits == [] and n == 0, f"variant {kw} hit another variant's blocks"
    first_hashes = {m.get_blocks(f"r{i}")[0].block_hash for i in range(len(variants))}
    assert None not in first_hashes and len(first_hashes) == len(variants)
    # The same variant again does hit.
    r = make_req("salted-again", prompt, cache_salt="alice")
    hits, n = m.get_computed_blocks(r)
    assert n == 32 and [x.block_id for x in hits] == m.get_block_ids("r1")[:4]
    m.check_integrity()


def test_hash_function_properties():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 16
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4), None)
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(h0, [1, 2, 3, 4])  # the parent matters
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(None, [1, 2, 3, 4], (1, (), None)) != \
        hash_block_tokens(None, [1, 2, 3, 4], (2, (), None))
    # No aliasing between token ids and extra-key bytes or lengths.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [0]) != hash_block_tokens(None, [])


def test_hashes_identical_across_processes():
    code = (
        "from llmkit.kv_cache import hash_block_tokens as h\n"
        "p = h(None, list(range(16)), None)\n"
        "q = h(p, [5, 4, 3, 2**40, -1], (3, ('img',), 'salt'))\n"
        "print(p.hex(), q.hex())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    p = hash_block_tokens(None, list(range(16)), None)
    q = hash_block_tokens(p, [5, 4, 3, 2**40, -1], (3, ("img",), "salt"))
    assert out.stdout.split() == [p.hex(), q.hex()]
    # And the manager stores exactly these (extra keys = request.block_hash_extra_keys).
    m = KVCacheManager(num_blocks=4, block_size=16)
    r = make_req("r", list(range(17)))
    m.get_computed_blocks(r)
    assert r.block_hashes == [p]


def test_block_hashes_are_incremental_and_computed_once(monkeypatch):
    calls = []
    real = hashing_mod.hash_block_tokens_encoded

    def counting(parent, ids, extra):
        calls.append(tuple(ids))
        return real(parent, ids, extra)

    monkeypatch.setattr(hashing_mod, "hash_block_tokens_encoded", counting)
    m = KVCacheManager(num_blocks=16, block_size=4)
    r = make_req("r", list(range(10)))
    admit(m, r)  # prompt of 10: blocks 0, 1 full
    assert len(r.block_hashes) == 2 and len(calls) == 2
    run_step(r, 10)
    hashes_list = r.block_hashes
    for t in range(12):  # decode 12 tokens -> 22 tokens -> 5 full blocks
        r.append_output_token(100 + t)
        assert m.allocate_slots(r, 1) is not None
        run_step(r, 1)
    assert r.block_hashes is hashes_list  # append-only, same list
    assert len(r.block_hashes) == 5 and len(calls) == 5
    assert calls[2] == (8, 9, 100, 101)
    assert len(m.block_pool.cached_block_hash_to_block) == 5
    # Re-admission after preemption reuses the stored hashes: no new hashing.
    m.free(r)
    r.num_computed_tokens = 0
    hits, n, _ = admit(m, r)
    assert n == 20 and len(calls) == 5
    m.check_integrity()


def test_chunked_prefill_caches_blocks_as_they_fill():
    m = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(30))
    a = make_req("a", prompt)
    admit(m, a, num_new_tokens=10)  # chunk 1: tokens 0..9 -> 2 full blocks cached
    run_step(a, 10)
    assert m.num_cached_blocks["a"] == 2
    b = make_req("b", prompt)
    hits, n = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(a, 10) is not None  # chunk 2: tokens 10..19 -> 5 full blocks
    run_step(a, 10)
    assert m.num_cached_blocks["a"] == 5
    hits, n = m.get_computed_blocks(make_req("c", prompt))
    assert n == 20
    m.check_integrity()


def test_lookahead_reserves_slots_but_is_never_cached():
    m = KVCacheManager(num_blocks=16, block_size=4)
    r = make_req("r", list(range(8)))
    new = m.allocate_slots(r, 8, num_lookahead_tokens=5)  # 13 slots -> 4 blocks
    assert len(new) == 4
    blocks = m.get_blocks("r")
    assert [x.block_hash is not None for x in blocks] == [True, True, False, False]
    assert len(m.block_pool.cached_block_hash_to_block) == 2 and len(r.block_hashes) == 2
    run_step(r, 8)
    r.append_output_token(42)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=3) == []  # 12 slots fit in 4 blocks
    # 9 known tokens: still only 2 full blocks are cached.
    assert len(m.block_pool.cached_block_hash_to_block) == 2
    # Draft tokens scheduled beyond the known tokens are not cached either.
    run_step(r, 1)
    assert m.allocate_slots(r, 4) == []  # 13 slots (9 known + 4 unknown)
    assert len(m.block_pool.cached_block_hash_to_block) == 2
    m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == 16


def test_max_model_len_caps_lookahead():
    m = KVCacheManager(num_blocks=16, block_size=4, max_model_len=10)
    r = make_req("r", list(range(8)))
    assert len(m.allocate_slots(r, 8, num_lookahead_tokens=5)) == 3  # min(13, 10) -> 3 blocks


def test_reset_prefix_cache_refuses_while_blocks_in_use():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(13))
    a = make_req("a", prompt)
    admit(m, a)
    assert m.reset_prefix_cache() is False
    assert len(m.block_pool.cached_block_hash_to_block) == 3
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.block_pool.cached_block_hash_to_block == {}
    hits, n = m.get_computed_blocks(make_req("b", prompt))
    assert hits == [] and n == 0
    m.check_integrity()


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prompt = list(range(13))
    for i in range(3):
        r = make_req(f"r{i}", prompt)
        hits, n, new = admit(m, r)
        assert hits == [] and n == 0 and len(new) == 4
        m.free(r)
    assert m.block_pool.cached_block_hash_to_block == {}
    assert m.prefix_cache_stats == PrefixCacheStats()
    m.check_integrity()


def test_prefix_cache_stats_exact():
    m = KVCacheManager(num_blocks=32, block_size=4)
    assert m.prefix_cache_stats.hit_rate == 0.0
    p = list(range(18))
    a = make_req("a", p)                       # 18 queried, 0 hit
    admit(m, a)
    b = make_req("b", p)                       # 18 queried, 16 hit ((18-1)//4 = 4 blocks)
    admit(m, b)
    c = make_req("c", p[:9] + [77] * 4)        # 13 queried, 8 hit (blocks 0, 1)
    admit(m, c)
    d = make_req("d", [5] * 3)                 # 3 queried, 0 hit
    admit(m, d)
    e = make_req("e", p[:8])                   # 8 queried, 4 hit ((8-1)//4 = 1 block)
    admit(m, e)
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (5, 60, 28)
    assert s.hit_rate == pytest.approx(28 / 60)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (0, 0, 0)
    # Cumulative and a snapshot: later admissions do not change an earlier object.
    admit(m, make_req("f", p))
    assert (s.queries, s.hits) == (60, 28)
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (78, 44)


def test_prefix_cache_stats_count_admissions_not_lookups():
    """As vLLM counts: a lookup enters the stats when its request is admitted (allocate_slots
    succeeds); a waiting head looked up again and again while blocks are short counts once."""
    m = KVCacheManager(num_blocks=6, block_size=4)
    p = list(range(9))
    a = make_req("a", p)
    admit(m, a)                                # 9 queried, 0 hit; holds 3 blocks
    c = make_req("c", list(range(50, 58)))
    admit(m, c)                                # 8 queried, 0 hit; holds 2 blocks, 1 free
    big = make_req("big", p[:8] + list(range(100, 112)))  # 20 tokens: 2 blocks hit, 3 new
    for _ in range(3):                         # the waiting head, tried at 3 steps: no room
        assert admit(m, big)[2] is None
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 17, 0)
    m.free(c)
    hits, n_hit, new = admit(m, big)           # now it fits: counted once
    assert new is not None and n_hit == 8
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (3, 37, 8)
    m.free(big)
    m.free(a)
    # A lookup followed by a failed allocation is not counted ...
    huge = make_req("huge", list(range(200, 240)))  # 10 blocks > 6
    hits, n_hit, new = admit(m, huge)
    assert new is None
    assert m.prefix_cache_stats.requests == 3
    # ... nor is an allocation without a lookup (a running request's next tokens).
    m.get_computed_blocks(make_req("probe", p))
    r = make_req("r", [7] * 5)
    assert m.allocate_slots(r, 5) is not None
    assert m.prefix_cache_stats.requests == 3
    m.free(r)
    # A re-admission after preemption counts again, and in the preempted_* share.
    a2 = make_req("a2", p)
    a2.num_preemptions = 1
    hits, n_hit, new = admit(m, a2)
    assert n_hit == 8
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (4, 46, 16)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 9, 8)
    m.free(a2)
    m.check_integrity()


def test_preempted_request_readmitted_hits_its_own_blocks():
    m = KVCacheManager(num_blocks=16, block_size=4)
    r = make_req("r", list(range(11)))
    admit(m, r)
    run_step(r, 11)
    for t in range(5):
        r.append_output_token(200 + t)
        m.allocate_slots(r, 1)
        run_step(r, 1)
    ids = m.get_block_ids("r")
    m.free(r)  # preempted
    r.num_computed_tokens = 0
    hits, n, new = admit(m, r)
    assert n == (r.num_tokens - 1) // 4 * 4 == 12
    assert [x.block_id for x in hits] == ids[:3]
    assert r.num_computed_tokens == 12 and len(new) == 1
    m.check_integrity()


def test_stale_computed_blocks_are_rejected():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", list(range(9)))
    admit(m, a)
    m.free(a)
    b = make_req("b", list(range(9)))
    hits, n = m.get_computed_blocks(b)
    assert n == 8
    m.allocate_slots(make_req("x", list(range(100, 116))), 16)  # evicts everything
    with pytest.raises(ValueError, match="stale"):
        m.allocate_slots(b, 1, new_computed_blocks=hits, num_new_computed_tokens=n)


def test_registry_and_interface():
    assert KV_CACHE_MANAGERS.get("paged") is KVCacheManager
    assert issubclass(KVCacheManager, KVCacheManagerBase)
    m = KV_CACHE_MANAGERS.get("paged")(num_blocks=4, block_size=16)
    assert (m.num_blocks, m.block_size, m.enable_prefix_caching) == (4, 16, True)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=16)


# -- integrity checks catch corruption -----------------------------------------------------
def _busy_manager() -> tuple[KVCacheManager, Request]:
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(13)))
    admit(m, a)
    b = make_req("b", list(range(100, 109)))
    admit(m, b)
    m.free(b)
    m.check_integrity()
    return m, a


def test_integrity_detects_wrong_ref_cnt():
    m, a = _busy_manager()
    m.get_blocks("a")[0].ref_cnt += 1
    with pytest.raises(KVCacheIntegrityError, match="ref_cnt"):
        m.check_integrity()


def test_integrity_detects_held_block_in_free_queue():
    m, a = _busy_manager()
    m.block_pool.empty_block_queue.append(m.get_blocks("a")[1])
    with pytest.raises(KVCacheIntegrityError, match="free queue"):
        m.check_integrity()


def test_integrity_detects_bad_hash_table_entry():
    m, a = _busy_manager()
    table = m.block_pool.cached_block_hash_to_block
    h = next(iter(table))
    table[h] = m.block_pool.blocks[7]
    with pytest.raises(KVCacheIntegrityError, match="hash"):
        m.check_integrity()


def test_integrity_detects_broken_links_and_counts():
    m, a = _busy_manager()
    q = m.block_pool.empty_block_queue
    q.num_free_blocks += 1
    with pytest.raises(KVCacheIntegrityError, match="num_free_blocks"):
        m.check_integrity()
    q.num_free_blocks -= 1
    first = q.head.next_free
    first.next_free.prev_free = q.head
    with pytest.raises(KVCacheIntegrityError, match="prev_free"):
        m.check_integrity()


def test_integrity_detects_freed_block_still_held():
    m, a = _busy_manager()
    blk = m.get_blocks("a")[2]
    m.block_pool.free_blocks([blk])  # freed behind the request's back
    with pytest.raises(KVCacheIntegrityError):
        m.check_integrity()


# -- randomized: bookkeeping and cached content stay correct --------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(1, 12)),
                 min_size=1, max_size=40),
    caching=st.booleans(),
)
def test_random_workload_keeps_integrity_and_correct_hits(ops, caching):
    bs, num_blocks = 4, 12
    m = KVCacheManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=caching)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [3] * 13,
               [1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1, 1, 1]]
    # What the KV "memory" of each block holds: the full token prefix it was computed for.
    content: dict[int, tuple[int, ...]] = {}
    running: dict[str, Request] = {}
    counter = 0

    def write(req: Request, upto: int) -> None:
        for i, blk in enumerate(m.get_blocks(req.request_id)[: upto // bs]):
            content[blk.block_id] = tuple(req.all_token_ids[: (i + 1) * bs])

    for kind, which, n in ops:
        if kind <= 1:  # admit a new request (chunk of up to n*2 tokens)
            counter += 1
            req = make_req(f"q{counter}", prompts[which % len(prompts)] + [counter % 3] * (n % 4))
            hits, n_hit = m.get_computed_blocks(req)
            for i, blk in enumerate(hits):  # a hit must hold exactly this prefix
                assert content.get(blk.block_id) == tuple(req.all_token_ids[: (i + 1) * bs])
            chunk = min(req.num_tokens - n_hit, 2 * n)
            new = m.allocate_slots(req, chunk, new_computed_blocks=hits,
                                   num_new_computed_tokens=n_hit)
            if new is not None:
                for blk in new:
                    content.pop(blk.block_id, None)
                req.num_computed_tokens = n_hit + chunk
                write(req, req.num_computed_tokens)
                running[req.request_id] = req
        elif kind == 2 and running:  # one step of a running request (prefill or decode)
            req = list(running.values())[which % len(running)]
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(n % 5)
            todo = min(req.num_tokens - req.num_computed_tokens, n)
            new = m.allocate_slots(req, todo, num_lookahead_tokens=which % 3)
            if new is not None:
                for blk in new:
                    content.pop(blk.block_id, None)
                req.num_computed_tokens += todo
                write(req, req.num_computed_tokens)
        elif kind == 3 and running:  # finish
            req = running.pop(list(running)[which % len(running)])
            m.free(req)
        elif kind == 4 and running:  # preempt: free, recompute later from scratch
            req = running.pop(list(running)[which % len(running)])
            m.free(req)
            req.num_computed_tokens = 0
        m.check_integrity()
        held = {i for r in running for i in m.get_block_ids(r)}  # shared blocks count once
        assert m.num_free_blocks == num_blocks - len(held)
        if not caching:
            assert m.block_pool.cached_block_hash_to_block == {}
    for req in running.values():
        m.free(req)
    m.check_integrity()
    assert m.num_free_blocks == num_blocks and m.usage == 0.0
