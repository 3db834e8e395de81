"""Eviction policies: which free *cached* block is reused for new content next.

The :class:`~llmkit.kv_cache.block_pool.BlockPool` decides *when* to evict: only when no empty
free block (one holding nothing reusable) is left, so under every policy empty blocks are
reused before any cached prefix is dropped. A policy only orders the free cached blocks.

Policies are chosen by name (``kv_cache.eviction_policy``) through :data:`EVICTION_POLICIES`:

- ``lru`` (default): least recently freed first; a freed request's tail blocks before its
  prefix (the pool hands them over tail first). One intrusive linked list, every operation O(1).
- ``lfu``: fewest hits first (``KVCacheBlock.hits``: how many times a request took the block as a
  prefix-cache hit since it was filled), ties broken by LRU order. One LRU list per hit count
  plus a heap of the counts in use: O(1) remove, O(log #distinct counts) per run of equal
  counts added and per bucket emptied by eviction.

A third party adds a policy by subclassing :class:`EvictionPolicy` and registering it, either
``EVICTION_POLICIES.register("name")(MyPolicy)`` or an entry point in the group
``llmkit.kv_cache.eviction_policy``.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

from llmkit.kv_cache.base import KVCacheIntegrityError
from llmkit.kv_cache.block_pool import FreeBlockQueue, KVCacheBlock
from llmkit.registry import Registry, UnknownImplementation


class EvictionPolicy(ABC):
    """Holds the free cached blocks (``ref_cnt == 0``, hash registered, not pinned) and picks
    the next one to evict.

    Contract with the pool (it calls nothing else, and only with blocks in these states):

    - ``num_free_blocks``: an ``int`` attribute, the number of blocks held; read on hot paths,
      so keep it a plain attribute, not a property.
    - ``add(blocks)``: blocks whose last reference was just dropped, in the order the pool
      would evict them among themselves (a request's tail block first).
    - ``remove(block)``: a held block is taken back by a cache hit. Called *before* the
      block's ``hits`` is incremented (``hits`` is maintained only if ``uses_hits``).
    - ``pop(n)``: remove and return ``n`` blocks to evict, first victim first;
      ``0 <= n <= num_free_blocks``. The pool then drops their hashes.
    - iteration yields the blocks in eviction order (for checks and debugging).

    A block held by the policy is in no other list, so a policy may use the block's
    ``prev_free``/``next_free`` links. ``check()`` verifies the policy's own structure and
    raises :class:`KVCacheIntegrityError`; the manager's ``check_integrity()`` calls it.
    """

    __slots__ = ()
    #: The registered name (informational).
    name: str = ""
    #: Whether the policy reads ``KVCacheBlock.hits``; when False the pool does not maintain it.
    uses_hits: bool = True
    num_free_blocks: int

    def __len__(self) -> int:
        return self.num_free_blocks

    @abstractmethod
    def add(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    @abstractmethod
    def remove(self, block: KVCacheBlock) -> None: ...

    @abstractmethod
    def pop(self, n: int) -> list[KVCacheBlock]: ...

    @abstractmethod
    def __iter__(self) -> Iterator[KVCacheBlock]: ...

    def check(self) -> None:
        """Raise :class:`KVCacheIntegrityError` if the policy's own structure is inconsistent."""


class LRUEvictionPolicy(FreeBlockQueue, EvictionPolicy):
    """Least recently freed first: the free queue itself (append at the tail, evict the head).

    It *is* a :class:`FreeBlockQueue`, so the pool's calls go straight to the list operations
    with no extra indirection on the default path.
    """

    __slots__ = ()
    name = "lru"
    uses_hits = False

    # FreeBlockQueue already has remove, __iter__ and num_free_blocks.
    add = FreeBlockQueue.append_n
    pop = FreeBlockQueue.popleft_n

    def __init__(self) -> None:
        FreeBlockQueue.__init__(self)

    def check(self) -> None:
        self.check_links("eviction queue (lru)")


class LFUEvictionPolicy(EvictionPolicy):
    """Fewest hits first; among blocks with as many hits, least recently freed first.

    ``_buckets[h]`` is the LRU list of the free blocks with ``hits == h``; a bucket exists only
    while non-empty. ``_heap`` is a min-heap of the bucket keys (``_in_heap``: the keys with a
    live entry), plus ``_stale`` entries of buckets deleted since; those are skipped when they
    surface, and the heap is rebuilt when they outnumber the live ones, so memory stays
    O(distinct hit counts among free blocks) however large counts grow.
    """

    __slots__ = ("num_free_blocks", "_buckets", "_heap", "_in_heap", "_stale")
    name = "lfu"

    def __init__(self) -> None:
        self.num_free_blocks = 0
        self._buckets: dict[int, FreeBlockQueue] = {}
        self._heap: list[int] = []
        self._in_heap: set[int] = set()
        self._stale = 0

    def _bucket(self, hits: int) -> FreeBlockQueue:
        q = self._buckets.get(hits)
        if q is None:
            q = self._buckets[hits] = FreeBlockQueue()
            self._in_heap.add(hits)
            heapq.heappush(self._heap, hits)
        return q

    def _drop_empty(self, hits: int) -> None:
        """Delete an emptied bucket whose heap entry stays behind (stale)."""
        del self._buckets[hits]
        self._in_heap.discard(hits)
        self._stale += 1
        if self._stale > 16 + len(self._buckets):
            self._heap = list(self._buckets)
            heapq.heapify(self._heap)
            self._in_heap = set(self._buckets)
            self._stale = 0

    def add(self, blocks: Sequence[KVCacheBlock]) -> None:
        # A request's blocks mostly share one hit count: append runs of equal counts at once.
        n = len(blocks)
        i = 0
        while i < n:
            h = blocks[i].hits
            j = i + 1
            while j < n and blocks[j].hits == h:
                j += 1
            self._bucket(h).append_n(blocks[i:j] if i or j < n else blocks)
            i = j
        self.num_free_blocks += n

    def remove(self, block: KVCacheBlock) -> None:
        h = block.hits
        q = self._buckets.get(h)
        prev, nxt = block.prev_free, block.next_free
        if q is None or prev is None or nxt is None:
            raise ValueError(f"{block!r} is not held by the lfu policy")
        # FreeBlockQueue.remove, inlined: this is on every cache hit.
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        q.num_free_blocks -= 1
        self.num_free_blocks -= 1
        if not q.num_free_blocks:
            self._drop_empty(h)

    def pop(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} evictable")
        out: list[KVCacheBlock] = []
        heap, buckets = self._heap, self._buckets
        need = n
        while need > 0:
            h = heap[0]
            q = buckets.get(h)
            if q is None:  # a deleted bucket's entry
                heapq.heappop(heap)
                self._stale -= 1
                continue
            k = q.num_free_blocks
            if k > need:
                out += q.popleft_n(need)
                break
            out += q.popleft_n(k)
            need -= k
            # The bucket is empty: drop it with its live entry, which is on top. Stale entries
            # of the same count, if any, stay and are skipped later.
            heapq.heappop(heap)
            del buckets[h]
            self._in_heap.discard(h)
        self.num_free_blocks -= n
        return out

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for h in sorted(self._buckets):
            yield from self._buckets[h]

    def check(self) -> None:
        total = 0
        for h, q in self._buckets.items():
            q.check_links(f"eviction queue (lfu, hits={h})")
            if not q.num_free_blocks:
                raise KVCacheIntegrityError(f"lfu: bucket {h} is empty but kept")
            for b in q:
                if b.hits != h:
                    raise KVCacheIntegrityError(
                        f"lfu: block {b.block_id} has hits={b.hits} but sits in bucket {h}")
            total += q.num_free_blocks
        if self._in_heap != set(self._buckets) or not self._in_heap <= set(self._heap):
            raise KVCacheIntegrityError("lfu: the heap does not cover exactly the buckets")
        if len(self._heap) != len(self._buckets) + self._stale:
            raise KVCacheIntegrityError(f"lfu: heap of {len(self._heap)} entries for "
                                        f"{len(self._buckets)} buckets and {self._stale} stale")
        if total != self.num_free_blocks:
            raise KVCacheIntegrityError(f"lfu: buckets hold {total} blocks but "
                                        f"num_free_blocks={self.num_free_blocks}")


EVICTION_POLICIES: Registry[EvictionPolicy] = Registry(
    "kv_cache.eviction_policy", entry_point_group="llmkit.kv_cache.eviction_policy")
EVICTION_POLICIES.register("lru")(LRUEvictionPolicy)
EVICTION_POLICIES.register("lfu")(LFUEvictionPolicy)


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A new policy instance by registered name; ``ValueError`` naming the config key if unknown."""
    try:
        cls = EVICTION_POLICIES.get(name)
    except (UnknownImplementation, TypeError):
        raise ValueError(f"kv_cache.eviction_policy: got {name!r}; allowed: "
                         f"{', '.join(EVICTION_POLICIES.names())}") from None
    return cls()
