"""Eviction policies (lru, lfu), pinned prefixes, step stats and the useless-block-size warning."""
from __future__ import annotations

import logging

import pytest

from llmkit.kv_cache import (EVICTION_POLICIES, BlockPool, EvictionPolicy, KVCacheManager,
                             LFUEvictionPolicy, LRUEvictionPolicy, PrefixCacheStats)
from llmkit.kv_cache.base import KVCacheIntegrityError
from llmkit.kv_cache.block_pool import FreeBlockQueue, KVCacheBlock
from llmkit.request import Request
from llmkit.sampling.params import SamplingParams

POLICIES = ["lru", "lfu"]


def make_req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), **kw)


def admit(m: KVCacheManager, req: Request) -> tuple[int, list | None]:
    """What the scheduler does for a waiting request: look up hits, allocate the whole prompt."""
    hits, n_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n_hit, new_computed_blocks=hits,
                           num_new_computed_tokens=n_hit)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    m.check_integrity()
    return n_hit, new


def run_and_free(m: KVCacheManager, req: Request) -> int:
    """Admit, compute the prompt, finish; the number of tokens that hit."""
    n_hit, new = admit(m, req)
    assert new is not None, f"{req.request_id} did not fit"
    m.free(req)
    m.check_integrity()
    return n_hit


def cached_hit_tokens(m: KVCacheManager, tokens: list[int]) -> int:
    """How many tokens of this prompt are still in the cache (a lookup only, nothing taken)."""
    return m.get_computed_blocks(make_req("probe", tokens))[1]


# -- the interface and the registry ----------------------------------------------------------
def test_registry_names_and_instances():
    assert {"lru", "lfu"} <= set(EVICTION_POLICIES.names())
    assert EVICTION_POLICIES.get("lru") is LRUEvictionPolicy
    assert EVICTION_POLICIES.get("lfu") is LFUEvictionPolicy
    for name in POLICIES:
        m = KVCacheManager(8, 4, eviction_policy=name)
        assert isinstance(m.block_pool.evictor, EvictionPolicy)
        assert m.block_pool.evictor.name == name and m.eviction_policy == name


def test_unknown_policy_names_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache\.eviction_policy.*'fifo'.*lfu, lru"):
        KVCacheManager(8, 4, eviction_policy="fifo")


def test_a_third_party_policy_plugs_in_by_name(monkeypatch):
    class MRU(LRUEvictionPolicy):
        """Most recently freed first: the opposite of lru (for the test)."""

        __slots__ = ()
        name = "mru"

        def pop(self, n):
            out = []
            for _ in range(n):
                b = self.tail.prev_free
                self.remove(b)
                out.append(b)
            return out

        def __iter__(self):
            return reversed(list(FreeBlockQueue.__iter__(self)))

    monkeypatch.setitem(EVICTION_POLICIES._entries, "mru", MRU)
    m = KVCacheManager(6, 4, eviction_policy="mru")
    a, b = list(range(9)), list(range(100, 109))  # 2 full blocks each
    run_and_free(m, make_req("a", a))
    run_and_free(m, make_req("b", b))
    # 6 blocks: 4 cached + 2 empty. Taking 4 evicts the 2 most recently freed: b's.
    assert m.allocate_slots(make_req("x", list(range(500, 516))), 16) is not None
    m.check_integrity()
    assert cached_hit_tokens(m, a) == 8 and cached_hit_tokens(m, b) == 0


# -- lru and lfu choose different victims ------------------------------------------------------
def _popular_then_recent(policy: str) -> KVCacheManager:
    """Pool of 8 blocks of 4. Prompt A (2 full blocks) is hit twice; prompt B (2 full blocks)
    is used once, *after* A. Then a request needing all 4 empty blocks + 2 more evicts two
    cached blocks."""
    m = KVCacheManager(8, 4, eviction_policy=policy)
    A, B = list(range(9)), list(range(100, 109))
    assert run_and_free(m, make_req("a0", A)) == 0
    assert run_and_free(m, make_req("a1", A)) == 8
    assert run_and_free(m, make_req("a2", A)) == 8
    assert run_and_free(m, make_req("b0", B)) == 0
    if policy == "lfu":
        cached = [b for b in m.block_pool.blocks if b.block_hash is not None]
        assert sorted(b.hits for b in cached) == [0, 0, 2, 2]
    assert m.num_free_blocks == 8 and m.block_pool.empty_block_queue.num_free_blocks == 4
    filler = make_req("filler", list(range(1000, 1024)))  # 6 blocks
    assert admit(m, filler)[1] is not None
    assert m.num_evictions == 2
    m.free(filler)
    m.check_integrity()
    return m


def test_lru_evicts_the_least_recently_used_even_if_popular():
    m = _popular_then_recent("lru")
    assert cached_hit_tokens(m, list(range(9))) == 0      # A, hit twice but older: evicted
    assert cached_hit_tokens(m, list(range(100, 109))) == 8  # B, used once but recently: kept


def test_lfu_evicts_the_least_frequently_hit_even_if_recent():
    m = _popular_then_recent("lfu")
    assert cached_hit_tokens(m, list(range(9))) == 8      # A, hit twice: kept
    assert cached_hit_tokens(m, list(range(100, 109))) == 0  # B, never hit: evicted


@pytest.mark.parametrize("policy", POLICIES)
def test_ties_follow_lru_order_tail_blocks_first(policy):
    """No hits anywhere: lfu degenerates to lru, a freed request's tail first, older first."""
    m = KVCacheManager(10, 4, eviction_policy=policy)
    a, b = make_req("a", list(range(12))), make_req("b", list(range(100, 112)))
    admit(m, a)
    admit(m, b)
    assert m.get_block_ids("a") == [0, 1, 2] and m.get_block_ids("b") == [3, 4, 5]
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert [x.block_id for x in m.block_pool.iter_free_blocks()] == [6, 7, 8, 9, 2, 1, 0, 5, 4, 3]
    new = m.allocate_slots(make_req("c", list(range(500, 524))), 24)
    assert [x.block_id for x in new] == [6, 7, 8, 9, 2, 1]
    m.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_blocks_are_reused_before_any_cached_block(policy):
    m = KVCacheManager(8, 4, eviction_policy=policy)
    run_and_free(m, make_req("a", list(range(13))))  # 3 cached + 1 empty (the 13th token)
    assert m.block_pool.evictor.num_free_blocks == 3
    r = make_req("r", list(range(100, 120)))  # 5 blocks = exactly the empty ones
    assert admit(m, r)[1] is not None
    assert m.num_evictions == 0 and cached_hit_tokens(m, list(range(13))) == 12
    m.free(r)
    m.check_integrity()


def test_lfu_order_within_and_across_hit_counts():
    m = KVCacheManager(16, 4, eviction_policy="lfu")
    prompts = {name: list(range(100 * i, 100 * i + 9)) for i, name in enumerate("abcd", 1)}
    hits_wanted = {"a": 2, "b": 0, "c": 1, "d": 0}
    for name, p in prompts.items():
        run_and_free(m, make_req(name, p))
        for k in range(hits_wanted[name]):
            run_and_free(m, make_req(f"{name}{k}", p))
    order = [x.hits for x in m.block_pool.evictor]
    assert order == [0, 0, 0, 0, 1, 1, 2, 2]  # fewest hits first
    # Among equal hits: b (freed first) before d, each tail block before its parent.
    req_b, req_d = make_req("qb", prompts["b"]), make_req("qd", prompts["d"])
    m.get_computed_blocks(req_b)
    m.get_computed_blocks(req_d)
    tbl = m.block_pool.cached_block_hash_to_block
    expected = [tbl[req_b.block_hashes[1]], tbl[req_b.block_hashes[0]],
                tbl[req_d.block_hashes[1]], tbl[req_d.block_hashes[0]]]
    assert list(m.block_pool.evictor)[:4] == expected


def test_hits_count_takes_not_lookups_and_reset_on_eviction():
    m = KVCacheManager(4, 4, eviction_policy="lfu")
    p = list(range(9))
    run_and_free(m, make_req("a", p))
    req = make_req("b", p)
    hits, n = m.get_computed_blocks(req)
    blk = hits[0]
    old_hash = blk.block_hash
    assert blk.hits == 0  # a lookup alone does not count
    m.get_computed_blocks(req)  # looked up again (e.g. still waiting)
    assert blk.hits == 0
    m.allocate_slots(req, 1, new_computed_blocks=hits, num_new_computed_tokens=n)
    assert blk.hits == 1  # taken once: one hit
    m.free(req)
    m.allocate_slots(make_req("evict-all", list(range(200, 216))), 16)  # new content
    assert blk.block_hash != old_hash and blk.hits == 0
    m.check_integrity()


def test_lfu_policy_alone():
    pol = LFUEvictionPolicy()
    blocks = [KVCacheBlock(i) for i in range(6)]
    for b, h in zip(blocks, [3, 0, 1, 0, 3, 1]):
        b.hits = h
    pol.add(blocks)
    pol.check()
    assert [b.block_id for b in pol] == [1, 3, 2, 5, 0, 4] and len(pol) == 6
    pol.remove(blocks[3])
    assert [b.block_id for b in pol.pop(2)] == [1, 2]
    pol.check()
    blocks[1].hits = 0
    pol.add([blocks[1]])  # bucket 0 becomes non-empty again
    assert [b.block_id for b in pol.pop(4)] == [1, 5, 0, 4] and pol.num_free_blocks == 0
    pol.check()
    with pytest.raises(ValueError):
        pol.pop(1)


def test_lfu_memory_stays_bounded_when_hit_counts_keep_growing():
    """A block hit again and again, freed in between, visits a new bucket each time; emptied
    buckets are dropped and the heap is rebuilt, so nothing grows with the hit count."""
    pol = LFUEvictionPolicy()
    cold, hot = KVCacheBlock(0), KVCacheBlock(1)
    pol.add([cold])
    for _ in range(1000):
        pol.add([hot])
        pol.remove(hot)  # a hit takes it back ...
        hot.hits += 1    # ... and counts
        pol.check()
    assert len(pol._buckets) == 1 and len(pol._heap) <= 2 * 1 + 17
    pol.add([hot])
    assert pol.pop(2) == [cold, hot]
    pol.check()


# -- pinned prefixes ---------------------------------------------------------------------------
SYSTEM = list(range(7000, 7008))  # 8 tokens: 2 full blocks of 4


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_prefix_survives_pressure_that_evicts_everything_else(policy):
    nb, bs = 16, 4
    m = KVCacheManager(nb, bs, eviction_policy=policy, pinned_prefixes=[SYSTEM])
    assert m.num_pinned_blocks == 0  # not computed yet
    sys_req = make_req("sys", SYSTEM + [1, 2, 3, 4, 5])  # 2 pinned blocks + 1 plain full block
    run_and_free(m, sys_req)
    assert m.num_pinned_blocks == 2
    assert m.num_free_blocks == nb - 2 and m.usage == pytest.approx(2 / nb)
    other = list(range(3000, 3009))
    run_and_free(m, make_req("other", other))
    for round_ in range(5):
        # Each round takes every free block with unrelated content.
        n_free = m.num_free_blocks
        big = make_req(f"fill{round_}", list(range(10_000 * (round_ + 1),
                                                   10_000 * (round_ + 1) + n_free * bs)))
        too_big = make_req(f"too-big{round_}", list(range(50_000, 50_000 + (n_free + 1) * bs)))
        assert admit(m, too_big)[1] is None  # pinned blocks are not free for allocation
        assert admit(m, big)[1] is not None
        assert m.num_free_blocks == 0
        m.free(big)
        m.check_integrity()
        assert m.num_free_blocks == nb - 2
    assert cached_hit_tokens(m, other) == 0
    assert cached_hit_tokens(m, SYSTEM + [1, 2, 3, 4, 5]) == 8  # the pinned 2 blocks, not the 3rd
    n_hit = run_and_free(m, make_req("user", SYSTEM + [9, 9, 9]))
    assert n_hit == 8 and m.num_free_blocks == nb - 2
    assert m.reset_prefix_cache()
    assert cached_hit_tokens(m, SYSTEM + [9]) == 8  # reset keeps pinned blocks
    m.check_integrity()


def test_pinned_blocks_shared_by_running_requests_keep_correct_counts():
    m = KVCacheManager(12, 4, pinned_prefixes=[SYSTEM])
    a, b = make_req("a", SYSTEM + [1, 2]), make_req("b", SYSTEM + [3, 4, 5])
    assert admit(m, a)[0] == 0
    assert admit(m, b)[0] == 8  # hits the pinned blocks while a holds them
    pinned = [blk for blk in m.block_pool.blocks if blk.pinned]
    assert len(pinned) == 2 and all(blk.ref_cnt == 2 for blk in pinned)
    used = 2 + 1 + 1
    assert m.num_free_blocks == 12 - used
    m.free(a)
    m.check_integrity()
    assert m.num_free_blocks == 12 - used + 1
    m.free(b)
    m.check_integrity()
    assert all(blk.ref_cnt == 0 and blk.prev_free is None for blk in pinned)
    assert m.num_free_blocks == 12 - 2
    # An idle pinned block taken again does not come out of the free count.
    c = make_req("c", SYSTEM + [7])
    hits, n = m.get_computed_blocks(c)
    assert n == 8
    before = m.num_free_blocks
    new = m.allocate_slots(c, 1, new_computed_blocks=hits, num_new_computed_tokens=n)
    assert len(new) == 1 and m.num_free_blocks == before - 1
    assert m.reset_prefix_cache() is False  # c holds blocks
    m.free(c)
    m.check_integrity()


def test_pinning_needs_the_exact_unsalted_chain_and_counts_distinct_blocks():
    other_pin = SYSTEM[:4] + [1, 1, 1, 1]  # shares the first block with SYSTEM
    m = KVCacheManager(12, 4, pinned_prefixes=[SYSTEM, other_pin])
    assert len(m.pinned_hashes) == 3
    run_and_free(m, make_req("salted", SYSTEM + [5], cache_salt="alice"))
    assert m.num_pinned_blocks == 0  # extra keys make other hashes: nothing pinned
    run_and_free(m, make_req("half", SYSTEM[:4] + [2, 2, 2, 2, 2]))
    assert m.num_pinned_blocks == 1  # only the shared first block
    run_and_free(m, make_req("full", SYSTEM + [5]))
    assert m.num_pinned_blocks == 2
    m.check_integrity()


def test_pinning_validation():
    with pytest.raises(ValueError,
                       match=r"kv_cache\.pinned_prefixes.*kv_cache\.enable_prefix_caching"):
        KVCacheManager(16, 4, enable_prefix_caching=False, pinned_prefixes=[SYSTEM])
    with pytest.raises(ValueError, match=r"kv_cache\.pinned_prefixes.*half of the pool"):
        KVCacheManager(8, 4, pinned_prefixes=[list(range(20))])  # 5 blocks > 4
    KVCacheManager(8, 4, pinned_prefixes=[list(range(16))])  # exactly half: fine
    with pytest.raises(ValueError, match=r"kv_cache\.pinned_prefixes\[0\].*shorter than one block"):
        KVCacheManager(8, 4, pinned_prefixes=[[1, 2, 3]])
    with pytest.raises(ValueError, match=r"kv_cache\.pinned_prefixes\[1\].*token ids"):
        KVCacheManager(8, 4, pinned_prefixes=[SYSTEM, "You are a helpful assistant"])
    with pytest.raises(ValueError, match=r"kv_cache\.pinned_prefixes"):
        KVCacheManager(8, 4, pinned_prefixes="abc")


def test_integrity_detects_a_pinned_block_in_the_free_lists():
    m = KVCacheManager(12, 4, pinned_prefixes=[SYSTEM])
    run_and_free(m, make_req("a", SYSTEM + [1]))
    blk = next(b for b in m.block_pool.blocks if b.pinned)
    m.block_pool.evictor.add([blk])
    with pytest.raises(KVCacheIntegrityError, match="pinned"):
        m.check_integrity()


def test_integrity_detects_a_corrupt_lfu_bucket():
    m = KVCacheManager(12, 4, eviction_policy="lfu")
    run_and_free(m, make_req("a", list(range(9))))
    next(iter(m.block_pool.evictor)).hits += 5  # its bucket no longer matches
    with pytest.raises(KVCacheIntegrityError, match="lfu"):
        m.check_integrity()


def test_block_pool_uses_a_given_policy_instance():
    pol = LFUEvictionPolicy()
    pool = BlockPool(4, enable_caching=True, eviction_policy=pol)
    assert pool.evictor is pol


# -- observability -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_step_stats_are_deltas_and_cumulative_stats_stay(policy):
    m = KVCacheManager(6, 4, eviction_policy=policy)
    p = list(range(9))
    assert m.take_step_stats() == PrefixCacheStats()
    run_and_free(m, make_req("a", p))                    # 9 queried, 0 hit
    run_and_free(m, make_req("b", p))                    # 9 queried, 8 hit
    assert m.take_step_stats() == PrefixCacheStats(requests=2, queries=18, hits=8, evictions=0)
    assert m.take_step_stats() == PrefixCacheStats()     # nothing since
    run_and_free(m, make_req("c", list(range(100, 124))))  # 6 blocks: evicts the 2 cached
    step = m.take_step_stats()
    assert (step.requests, step.queries, step.hits, step.evictions) == (1, 24, 0, 2)
    total = m.prefix_cache_stats
    assert (total.requests, total.queries, total.hits, total.evictions) == (3, 42, 8, 2)
    assert m.num_evictions == 2


LOGGER = "llmkit.kv_cache"


def _useless_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and "block_size" in r.message]


def _serve(m: KVCacheManager, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        run_and_free(m, make_req(f"r{i}", p))


def _prompts(shared: int, n: int = 80, tail: int = 24) -> list[list[int]]:
    """n prompts that all start with the same ``shared`` tokens, then differ."""
    head = list(range(9000, 9000 + shared))
    return [head + list(range(100_000 * (i + 1), 100_000 * (i + 1) + tail)) for i in range(n)]


def test_warns_once_when_shared_prefixes_are_shorter_than_a_block(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = KVCacheManager(64, 16)
    _serve(m, _prompts(shared=12))  # 12 shared tokens < 16: whole-block caching never hits
    warnings = _useless_warnings(caplog)
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "kv_cache.block_size=16" in msg and "smaller kv_cache.block_size" in msg
    assert m.prefix_cache_stats.hits == 0


@pytest.mark.parametrize("block_size,shared", [(4, 12), (16, 40)])
def test_no_warning_when_prefix_caching_hits(caplog, block_size, shared):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = KVCacheManager(256, block_size)
    _serve(m, _prompts(shared=shared))
    assert m.prefix_cache_stats.hits > 0
    assert _useless_warnings(caplog) == []


def test_no_warning_when_prompts_share_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = KVCacheManager(64, 16)
    _serve(m, _prompts(shared=0))
    assert _useless_warnings(caplog) == []


def test_a_waiting_request_looked_up_again_counts_once(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = KVCacheManager(64, 16)
    r = make_req("stuck", _prompts(shared=12, n=1)[0])
    for _ in range(100):  # a request that cannot be admitted is looked up at every step
        m.get_computed_blocks(r)
    assert _useless_warnings(caplog) == []


def test_detector_off_without_caching_or_with_tiny_blocks():
    assert not KVCacheManager(8, 16, enable_prefix_caching=False)._probe_on
    assert not KVCacheManager(8, 4)._probe_on  # sharing < 4 tokens is template noise
    assert KVCacheManager(8, 8)._probe_on
