"""The pool that owns every KV cache block (``blocks.py``: the block and its intrusive free list),
the free empty blocks, the eviction policy holding the free cached ones, and the prefix-hash
table.

A block is in exactly one of these states:
- held: ``ref_cnt > 0`` (one count per request using it), in no free list;
- free and empty: ``ref_cnt == 0``, no hash, in the pool's ``empty_block_queue``;
- free and cached: ``ref_cnt == 0``, ``block_hash`` set and registered in the hash table, held
  by the eviction policy (``BlockPool.evictor``), so a later request with the same prefix can
  take it back (a hit) until the policy picks it for eviction;
- pinned and idle: ``ref_cnt == 0``, ``pinned``, hash registered, in no free list: a block of a
  pinned prefix stays cached for good and is not free for allocation.
Reusing a free cached block for new tokens evicts it (its hash is dropped). Empty blocks are
always reused before any cached block is evicted, whatever the policy.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

# KVCacheBlock and FreeBlockQueue are re-exported here, where they used to live.
from llmkit.kv_cache.blocks import FreeBlockQueue, KVCacheBlock
from llmkit.kv_cache.eviction import EvictionPolicy, make_eviction_policy

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock"]


class BlockPool:
    """All KV blocks, the free empty blocks, the eviction policy holding the free cached blocks,
    and the prefix-cache table ``hash -> block``.

    At most one block per hash is registered: when a second block fills with the same
    content (two requests prefilling the same prefix at once), it stays unregistered and
    is simply recycled when freed. A block registered under a hash of ``pinned_hashes`` is
    pinned: it is never handed to the eviction policy.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 eviction_policy: str | EvictionPolicy = "lru",
                 pinned_hashes: Iterable[bytes] = ()) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        #: Free blocks holding nothing reusable; reused before any cached block is evicted.
        self.empty_block_queue = FreeBlockQueue(self.blocks)
        #: Holds the free cached blocks and picks which one to evict next.
        self.evictor: EvictionPolicy = (make_eviction_policy(eviction_policy)
                                        if isinstance(eviction_policy, str) else eviction_policy)
        self._track_hits = bool(self.evictor.uses_hits)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.pinned_hashes: frozenset[bytes] = frozenset(pinned_hashes)
        #: Pinned blocks registered so far (held or idle); they never leave the cache.
        self.num_pinned_blocks = 0
        #: Cached blocks whose content was dropped to reuse them (cumulative).
        self.num_evictions = 0
        #: The null block (``reserve_null_block``): never allocated, freed nor cached; None
        #: for a one-group pool, which has none.
        self.null_block: KVCacheBlock | None = None
        self._num_reserved = 0
        #: Called with ``[(block_id, block_hash)]`` of the cached blocks about to be reused
        #: (a KV connector keeps their content in an offload tier); None = nobody listens.
        self.eviction_listener: Callable[[list[tuple[int, bytes]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation: empty ones plus evictable cached ones."""
        return self.empty_block_queue.num_free_blocks + self.evictor.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks not available for allocation: held by requests or pinned."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - self._num_reserved)

    def reserve_null_block(self) -> KVCacheBlock:
        """Take the first free block out of the pool for good: it stands in a block table for
        the blocks a sliding window freed (vLLM's null block). Its memory is never written (no
        slot maps into it), so whatever reads it there is masked."""
        if self.null_block is None:
            self.null_block = self.empty_block_queue.popleft()
            self._num_reserved = 1
        return self.null_block

    def iter_free_blocks(self) -> Iterator[KVCacheBlock]:
        """Free blocks in the order they would be reused: empty ones, then cached ones in the
        policy's eviction order. For checks and debugging, not for hot paths."""
        yield from self.empty_block_queue
        yield from self.evictor

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks: empty ones first, then cached ones the policy evicts."""
        empty = self.empty_block_queue
        k = empty.num_free_blocks
        if n <= k:
            blocks = empty.popleft_n(n)
            for b in blocks:
                b.ref_cnt = 1
            return blocks
        evictor = self.evictor
        if n - k > evictor.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {k + evictor.num_free_blocks} free")
        if k:
            blocks = empty.popleft_n(k)
            for b in blocks:
                b.ref_cnt = 1
            evicted = evictor.pop(n - k)
            blocks += evicted
        else:
            blocks = evicted = evictor.pop(n)
        table = self.cached_block_hash_to_block
        if self.eviction_listener is not None and evicted:
            self.eviction_listener([(b.block_id, b.block_hash) for b in evicted])
        if self._track_hits:
            for b in evicted:
                del table[b.block_hash]
                b.block_hash = None
                b.hits = 0
                b.ref_cnt = 1
        else:
            for b in evicted:
                del table[b.block_hash]
                b.block_hash = None
                b.ref_cnt = 1
        self.num_evictions += n - k
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits and count the hit; a free one leaves the eviction
        policy (no longer evictable)."""
        remove = self.evictor.remove
        if self._track_hits or self.num_pinned_blocks:
            for b in blocks:
                if b.ref_cnt == 0 and not b.pinned:
                    remove(b)
                b.ref_cnt += 1
                b.hits += 1
        else:  # the default path (lru, nothing pinned yet)
            for b in blocks:
                if b.ref_cnt == 0:
                    remove(b)
                b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; those reaching zero become free.

        Pass a request's blocks in reverse (tail first): freed cached blocks go to the eviction
        policy in that order, so under LRU a request's last blocks are evicted before its
        prefix, and everything freed now after everything freed earlier. Blocks without a hash
        hold nothing reusable and go to the head of the empty queue. Pinned blocks stay where
        they are: cached, idle, never evicted.
        """
        cached: list[KVCacheBlock] = []
        empty: list[KVCacheBlock] = []
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (empty if b.block_hash is None else cached).append(b)
        if cached:
            if self.num_pinned_blocks:
                cached = [b for b in cached if not b.pinned]
            self.evictor.add(cached)
        if empty:
            self.empty_block_queue.appendleft_n(empty)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          start: int, end: int, tag: bytes = b"") -> None:
        """Register ``blocks[start:end]`` (now full) under ``block_hashes[start:end]``, each
        followed by ``tag`` (a KV-cache group's, so that groups never serve each other).

        A block already hashed (a hit) and the null block are left alone; a hash already
        owned by another block leaves this one unregistered. A block registered under a pinned
        hash is pinned.
        """
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        pinned = self.pinned_hashes
        null = self.null_block
        for i in range(start, end):
            b = blocks[i]
            if b.block_hash is not None or b is null:
                continue
            h = block_hashes[i] + tag if tag else block_hashes[i]
            if h not in table:
                table[h] = b
                b.block_hash = h
                if pinned and h in pinned:
                    b.pinned = True
                    self.num_pinned_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash except the pinned ones. Refuses (False) while any block is
        held by a request."""
        if (self.num_free_blocks + self._num_pinned_idle() + self._num_reserved
                != self.num_blocks):
            return False
        evictor = self.evictor
        dropped = evictor.pop(evictor.num_free_blocks)
        for b in dropped:
            b.block_hash = None
            b.hits = 0
        # Same reuse order as before the reset: the formerly cached blocks after the empty ones.
        self.empty_block_queue.append_n(dropped)
        table = self.cached_block_hash_to_block
        if self.num_pinned_blocks:
            for h in [h for h, b in table.items() if not b.pinned]:
                del table[h]
        else:
            table.clear()
        return True

    def _num_pinned_idle(self) -> int:
        if not self.num_pinned_blocks:
            return 0
        return sum(1 for b in self.blocks if b.pinned and b.ref_cnt == 0)
