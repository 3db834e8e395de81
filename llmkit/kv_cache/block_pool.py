"""The pool that owns every KV cache block: the block, its intrusive free list, the free empty
blocks, the eviction policy holding the free cached ones, and the prefix-hash table.

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

The policies (``eviction.py``) keep their blocks in free lists of this module (LRU's *is* one),
so they import it; the pool is handed its policy (the manager makes it from
``kv_cache.eviction_policy``) and never imports them: no cycle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from llmkit.kv_cache.base import KVCacheIntegrityError

if TYPE_CHECKING:
    from llmkit.kv_cache.eviction import EvictionPolicy

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """One block of ``block_size`` KV slots.

    ``prev_free``/``next_free`` link the free list the block is in (if any). ``hits`` counts
    the prefix-cache hits on the block's current content (reset when evicted), maintained only
    when the eviction policy uses it (``EvictionPolicy.uses_hits``: lfu does, lru does not, to
    keep the default path lean); ``pinned`` marks a block of a pinned prefix, never evicted.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "hits", "pinned")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: bytes | None = None) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.hits = 0
        self.pinned = False

    def __repr__(self) -> str:  # never follow the links: the list is long and cyclic-looking
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        pin = ", pinned" if self.pinned else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}{pin})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in reuse order: the head is reused first.

    Intrusive (links live in the blocks) with sentinel head and tail, so every operation,
    including ``remove`` from the middle on a prefix-cache hit, is O(1) with no branches
    for the ends and no allocation.
    """

    __slots__ = ("head", "tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail; for debugging and checks, not for hot paths."""
        b = self.head.next_free
        tail = self.tail
        while b is not tail and b is not None:
            yield b
            b = b.next_free

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free
        if first is self.tail:
            raise ValueError("no free blocks")
        nxt = first.next_free
        self.head.next_free = nxt
        nxt.prev_free = self.head
        first.prev_free = first.next_free = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        b = self.head.next_free
        append = out.append
        for _ in range(n):
            nxt = b.next_free
            b.prev_free = b.next_free = None
            append(b)
            b = nxt
        self.head.next_free = b
        b.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append in the given order (the first given is evicted first among them)."""
        self._insert_n(self.tail.prev_free, blocks, self.tail)

    def appendleft_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the head, in the given order: they are reused before all others."""
        self._insert_n(self.head, blocks, self.head.next_free)

    def _insert_n(self, prev: KVCacheBlock, blocks: Iterable[KVCacheBlock],
                  nxt: KVCacheBlock) -> None:
        """Link ``blocks``, in order, between the adjacent ``prev`` and ``nxt``."""
        n = 0
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
            n += 1
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free_blocks += n

    def check_links(self, name: str = "free queue") -> None:
        """Walk the list; raise :class:`KVCacheIntegrityError` on a broken link, a repeated
        block, a cycle or a count that disagrees with ``num_free_blocks``."""
        seen: set[int] = set()
        prev = self.head
        cur = self.head.next_free
        while cur is not self.tail:
            if cur is None:
                raise KVCacheIntegrityError(
                    f"{name} broken after block {prev.block_id}: next_free is None")
            if cur.prev_free is not prev:
                raise KVCacheIntegrityError(
                    f"{name}: block {cur.block_id}.prev_free is not block {prev.block_id}")
            if id(cur) in seen:
                raise KVCacheIntegrityError(f"{name}: block {cur.block_id} appears twice (cycle)")
            seen.add(id(cur))
            prev, cur = cur, cur.next_free
        if self.tail.prev_free is not prev:
            raise KVCacheIntegrityError(f"{name}: tail.prev_free is not the last block")
        if len(seen) != self.num_free_blocks:
            raise KVCacheIntegrityError(f"{name}: {len(seen)} blocks linked but "
                                        f"num_free_blocks={self.num_free_blocks}")



class BlockPool:
    """All KV blocks, the free empty blocks, the eviction policy holding the free cached blocks,
    and the prefix-cache table ``hash -> block``.

    At most one block per hash is registered: when a second block fills with the same
    content (two requests prefilling the same prefix at once), it stays unregistered and
    is simply recycled when freed. A block registered under a hash of ``pinned_hashes`` is
    pinned: it is never handed to the eviction policy.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, eviction_policy: EvictionPolicy,
                 pinned_hashes: Iterable[bytes] = ()) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        #: Free blocks holding nothing reusable; reused before any cached block is evicted.
        self.empty_block_queue = FreeBlockQueue(self.blocks)
        #: Holds the free cached blocks and picks which one to evict next.
        self.evictor: EvictionPolicy = eviction_policy
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
