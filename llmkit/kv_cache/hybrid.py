"""HybridKVCacheManager: one block pool, several KV-cache groups (``groups.py``), one
manager per group (``group_managers.py``) — vLLM's hybrid allocator and KV cache coordinator.

The scheduler's protocol is the one-group manager's; the blocks it passes around are per
group: ``get_computed_blocks`` returns a tuple with one list of hit blocks per group,
``allocate_slots`` a tuple with one list of new blocks per group, ``get_block_ids`` one id
list per group (the runner's block table of each group). A request's slots are allocated in
every group at once or in none. A prefix hit is the longest prefix every group can serve; a
model with a recurrent-state group has no prefix caching (the state after a prefix is not
kept).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from llmkit.attention.kv_spec import RecurrentStateSpec, SlidingWindowSpec
from llmkit.kv_cache.base import KVCacheIntegrityError, KVCacheManagerBase, PrefixCacheStats
from llmkit.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmkit.kv_cache.eviction import make_eviction_policy
from llmkit.kv_cache.group_managers import (GroupManager, RecurrentStateGroup,
                                            SlidingWindowGroup, make_group_manager)
from llmkit.kv_cache.groups import KVCacheGroup
from llmkit.kv_cache.hashing import PrefixCacheCounters, extend_block_hashes
from llmkit.kv_cache.integrity import check_pool, count_held

if TYPE_CHECKING:
    from llmkit.request import Request

logger = logging.getLogger("llmkit.kv_cache")

#: One list of blocks per KV-cache group.
GroupedBlocks = tuple[list[KVCacheBlock], ...]


class HybridKVCacheManager(KVCacheManagerBase):
    """Paged KV cache for a model whose layers keep different state (several KV-cache
    groups, or one that the plain manager does not serve: a window's). Block 0 of the pool is
    the null block (never allocated)."""

    grouped_block_ids = True

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, *, groups: Sequence[KVCacheGroup],
                 eviction_policy: str = "lru",
                 pinned_prefixes: Sequence[Sequence[int]] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        if not groups:
            raise ValueError("no KV-cache groups")
        if pinned_prefixes:
            raise ValueError("kv_cache.pinned_prefixes: not supported for a model with several "
                             f"KV-cache groups ({len(groups)}); leave it empty")
        if enable_prefix_caching and any(isinstance(g.spec, RecurrentStateSpec)
                                         for g in groups):
            logger.warning("kv_cache.enable_prefix_caching: off for this model: its recurrent "
                           "state is kept per request, not per block, so no prefix can be "
                           "reused")
            enable_prefix_caching = False
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.groups = tuple(groups)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching,
                                    make_eviction_policy(eviction_policy))
        self.null_block = self.block_pool.reserve_null_block()
        # full-attention groups first: their hits are prefix-closed, so the lookup's fixed
        # point is reached in fewer passes
        self.managers: tuple[GroupManager, ...] = tuple(
            make_group_manager(i, g.spec, self.block_pool, block_size, enable_prefix_caching)
            for i, g in enumerate(groups))
        self._lookup_order = sorted(range(len(groups)),
                                    key=lambda i: type(self.managers[i]) is not GroupManager)
        self.labels = tuple(f"{i}:{g.label}" for i, g in enumerate(groups))
        self.smaller_chunks_may_fit = any(isinstance(g.spec, SlidingWindowSpec) for g in groups)
        self._holding: set[str] = set()
        self.prefix_counters = PrefixCacheCounters()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # -- the scheduler's protocol ---------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupedBlocks, int]:
        """Per group, the blocks of the longest prefix every group can serve (a window's
        group needs only its last window's blocks; null blocks stand for the rest), and the
        prefix's token count; at most ``(num_tokens - 1) // block_size`` blocks."""
        empty: GroupedBlocks = tuple([] for _ in self.managers)
        if not self.enable_prefix_caching:
            return empty, 0
        if request.request_id in self._holding:
            raise ValueError(f"request {request.request_id!r} already holds blocks; "
                             "get_computed_blocks is for requests being admitted")
        self.prefix_counters.pending = request
        n = (request.num_tokens - 1) // self.block_size
        if n <= 0:
            return empty, 0
        hashes = extend_block_hashes(request, n, self.block_size)
        hits: list[list[KVCacheBlock]] = list(empty)
        managers = self.managers
        changed = True
        while changed:  # until every group serves the same length
            changed = False
            for i in self._lookup_order:
                hit = managers[i].find_hit(hashes, n)
                hits[i] = hit
                if len(hit) < n:
                    n = len(hit)
                    changed = True
            if n == 0:
                return empty, 0
        return tuple(hits), n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        *,
        new_computed_blocks: GroupedBlocks | Sequence = (),
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupedBlocks | None:
        """Slots for ``num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens`` tokens in every group (after each window's group gave back
        what its window left behind); the new blocks per group, or None (nothing changed but
        those windows)."""
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"request {request.request_id!r}: negative token count "
                             f"(num_new_tokens={num_new_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens})")
        if delay_cache_blocks:
            raise ValueError("delay_cache_blocks (a KV connector's asynchronous load) is not "
                             "supported with several KV-cache groups")
        rid = request.request_id
        managers = self.managers
        holding = rid in self._holding
        hits = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) \
            else None
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None and num_slots > self.max_model_len:
            num_slots = max(self.max_model_len, num_computed + num_new_tokens)
        num_evictable = 0
        if hits is not None:
            if holding:
                raise ValueError(f"request {rid!r} already holds blocks; computed blocks are "
                                 "only given at admission")
            hashes = request.block_hashes
            for m, hit in zip(managers, hits):
                if len(hit) > len(hashes):
                    raise ValueError(f"request {rid!r}: more computed blocks than block hashes")
                num_evictable += m.check_hit(hit, hashes)
        elif holding:
            for m in managers:
                m.remove_skipped(rid, request.num_computed_tokens)
        needed = num_evictable
        for i, m in enumerate(managers):
            needed += m.num_new_blocks(rid, num_slots, len(hits[i]) if hits else 0)
        pool = self.block_pool
        if needed and needed > pool.num_free_blocks:
            return None
        counters = self.prefix_counters
        if counters.pending is request:
            counters.admitted(request, num_new_computed_tokens)
        if hits is not None:  # every group's hits first: new blocks must not evict them
            for m, hit in zip(managers, hits):
                m.take_hit(rid, hit)
        new = tuple(m.allocate(rid, num_slots) for m in managers)
        self._holding.add(rid)
        if self.enable_prefix_caching:
            num_known = min(num_computed + num_new_tokens, request.num_tokens)
            num_full = num_known // self.block_size
            if num_full:
                hashes = extend_block_hashes(request, num_full, self.block_size)
                for m in managers:
                    m.cache(rid, hashes, num_full)
        return new

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first."""
        self.prefix_counters.forget(request)
        rid = request.request_id
        self._holding.discard(rid)
        pool = self.block_pool
        for m in self.managers:
            blocks = m.free(rid)
            if blocks:
                pool.free_blocks(blocks)

    def shrink_slots(self, request: Request, num_tokens: int) -> int:
        """Keep slots for the first ``num_tokens`` tokens in every group; blocks freed."""
        freed = 0
        pool = self.block_pool
        for m in self.managers:
            tail = m.shrink(request.request_id, num_tokens)
            if tail:
                pool.free_blocks(tail)
                freed += len(tail)
        return freed

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Every block the request holds, group after group (null blocks left out)."""
        null = self.null_block
        return [b for m in self.managers for b in m.req_to_blocks.get(request_id, ())
                if b is not null]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table row of each group (the null block's id where a window
        freed a block)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())]
                     for m in self.managers)

    def block_ids_update(self, request_id: str, new_blocks: GroupedBlocks
                         ) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """What the runner of a running request learns this step, per group: the new blocks'
        ids and where they start in its table row."""
        ids = tuple([b.block_id for b in new] for new in new_blocks)
        offsets = tuple(len(m.req_to_blocks.get(request_id, ())) - len(new)
                        for m, new in zip(self.managers, new_blocks))
        return ids, offsets

    def num_blocks_held(self, request_id: str) -> int:
        return sum(m.num_held(request_id) for m in self.managers)

    # -- state -----------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of the blocks (the null block aside) held by requests."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def kv_usage_by_group(self) -> dict[str, float]:
        """Per group (``"<index>:<spec>"``, e.g. ``"0:sliding_window(1024)"``), the fraction
        of the pool its requests hold. O(blocks held): for metrics, not every step."""
        usable = self.num_blocks - 1
        null = self.null_block
        out = {}
        for label, m in zip(self.labels, self.managers):
            held = {b.block_id for blocks in m.req_to_blocks.values() for b in blocks
                    if b is not null}
            out[label] = len(held) / usable
        return out

    @property
    def num_prefix_cached_blocks(self) -> int:
        return len(self.block_pool.cached_block_hash_to_block)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_counters.snapshot(self.block_pool.num_evictions)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """The one-group checks (``check_pool``) over every group's requests, plus per group:
        no block twice, blocks cached under this group's tag only, null blocks only before a
        window's held blocks (none for full attention), one block per recurrent state; and a
        request holds blocks in every group or in none. O(num_blocks)."""
        pool = self.block_pool
        null = self.null_block

        def fail(msg: str) -> None:
            raise KVCacheIntegrityError(msg)

        refs: Counter[int] = Counter()
        for m in self.managers:
            g = m.group_id
            window = isinstance(m, SlidingWindowGroup)
            for rid, req_blocks in m.req_to_blocks.items():
                if rid not in self._holding:
                    fail(f"group {g}: request {rid!r} holds blocks but is not marked holding")
                num_null = sum(b is null for b in req_blocks)
                if num_null and not window:
                    fail(f"group {g} ({m.spec}): request {rid!r} holds the null block")
                if any(b is null for b in req_blocks[num_null:]):
                    fail(f"group {g}: request {rid!r} has a null block after a held one")
                if isinstance(m, RecurrentStateGroup) and len(req_blocks) != 1:
                    fail(f"group {g} (recurrent state): request {rid!r} holds "
                         f"{len(req_blocks)} blocks, not one")
                for b in req_blocks[num_null:]:
                    if b.block_hash is not None and not b.block_hash.endswith(m.tag):
                        fail(f"group {g}: request {rid!r} holds block {b.block_id}, cached "
                             "for another group")
            refs.update(count_held(pool, m.req_to_blocks, m.num_cached, f"group {g}: "))
        for rid in self._holding:
            if not all(rid in m.req_to_blocks for m in self.managers):
                fail(f"request {rid!r} holds blocks in some KV-cache groups only")
        check_pool(pool, refs)
