"""A KV cache block and the intrusive doubly linked list of free blocks.

The pool (``block_pool.py``) owns the blocks; the eviction policies (``eviction.py``) hold the
free cached ones in lists like these. Both import this module, neither imports the other's.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from llmkit.kv_cache.base import KVCacheIntegrityError

__all__ = ["FreeBlockQueue", "KVCacheBlock"]


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
