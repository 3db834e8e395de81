"""One KV-cache group's blocks per request, over the pool every group shares (vLLM's
single-type managers): full attention (every block for the whole request), sliding window
(blocks that fell out of the window go back while the request runs) and recurrent state
(exactly one block per request).

A group's prefix-cache entries are keyed by the block's hash and the group's tag, so two
groups never serve each other's blocks. The pool's null block stands in a block table where a
window freed a block (or a prefix hit needs no block): it is never held, freed nor cached.
"""
from __future__ import annotations

from typing import Sequence

from llmkit.attention.kv_spec import KVCacheSpec, RecurrentStateSpec, SlidingWindowSpec
from llmkit.kv_cache.block_pool import BlockPool, KVCacheBlock

__all__ = ["FullAttentionGroup", "GroupManager", "RecurrentStateGroup", "SlidingWindowGroup",
           "make_group_manager"]


class GroupManager:
    """Full attention: a request holds the blocks of all its tokens until it ends.

    ``req_to_blocks[rid]`` is the request's block table row of this group (null blocks
    included), ``num_cached[rid]`` how many of its leading blocks are in the prefix cache (or
    came from it)."""

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: BlockPool, block_size: int,
                 enable_caching: bool) -> None:
        self.group_id = group_id
        self.spec = spec
        self.pool = pool
        self.null_block = pool.reserve_null_block()
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tag = group_id.to_bytes(2, "little")
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached: dict[str, int] = {}

    # -- prefix hits -------------------------------------------------------------------------
    def find_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of this group's cached blocks serving the first ``k <= max_blocks``
        blocks of a prefix (null blocks where none is needed); ``len`` of it is ``k``."""
        table = self.pool.cached_block_hash_to_block
        tag = self.tag
        hit: list[KVCacheBlock] = []
        for i in range(max_blocks):
            b = table.get(hashes[i] + tag)
            if b is None:
                break
            hit.append(b)
        return hit

    def check_hit(self, hit: Sequence[KVCacheBlock], hashes: Sequence[bytes]) -> int:
        """Raise if a hit block was evicted since the lookup; the number of hit blocks that
        leave the free blocks when taken."""
        null, tag = self.null_block, self.tag
        n = 0
        for i, b in enumerate(hit):
            if b is null:
                continue
            if b.block_hash != hashes[i] + tag:
                raise ValueError(f"computed block {b.block_id} of KV-cache group "
                                 f"{self.group_id} is stale (evicted since the lookup)")
            if b.ref_cnt == 0 and not b.pinned:
                n += 1
        return n

    # -- slots -------------------------------------------------------------------------------
    def remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free the blocks no later token reads (none for full attention)."""

    def num_new_blocks(self, rid: str, num_slots: int, num_hit: int) -> int:
        blocks = self.req_to_blocks.get(rid)
        n = -(-num_slots // self.block_size) - (len(blocks) if blocks else 0) - num_hit
        return n if n > 0 else 0

    def take_hit(self, rid: str, hit: Sequence[KVCacheBlock]) -> None:
        """Start the request's table with its prefix hit (referenced now, before any group
        allocates: a new block may otherwise evict another group's free hit block)."""
        blocks = self.req_to_blocks[rid] = list(hit)
        if hit:
            null = self.null_block
            self.pool.touch([b for b in blocks if b is not null])
            self.num_cached[rid] = len(hit)

    def allocate(self, rid: str, num_slots: int) -> list[KVCacheBlock]:
        """New blocks up to ``num_slots`` slots; them."""
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
        n = -(-num_slots // self.block_size) - len(blocks)
        new = self.pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new)
        return new

    def cache(self, rid: str, hashes: Sequence[bytes], num_full: int) -> None:
        """Enter the request's blocks up to its ``num_full`` full ones in the prefix cache."""
        if not self.enable_caching:
            return
        start = self.num_cached.get(rid, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[rid]
        self.pool.cache_full_blocks(blocks, hashes, start, min(num_full, len(blocks)), self.tag)
        self.num_cached[rid] = num_full

    def free(self, rid: str) -> list[KVCacheBlock]:
        """Forget the request; its held blocks, tail first (to free them in that order)."""
        self.num_cached.pop(rid, None)
        blocks = self.req_to_blocks.pop(rid, None)
        if not blocks:
            return []
        null = self.null_block
        return [b for b in reversed(blocks) if b is not null]

    def shrink(self, rid: str, num_tokens: int) -> list[KVCacheBlock]:
        """Drop the blocks past the first ``num_tokens`` tokens; them, tail first."""
        blocks = self.req_to_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if not blocks or keep >= len(blocks):
            return []
        tail = blocks[keep:]
        del blocks[keep:]
        if self.num_cached.get(rid, 0) > keep:
            self.num_cached[rid] = keep
        null = self.null_block
        return [b for b in reversed(tail) if b is not null]

    def num_held(self, rid: str) -> int:
        """Blocks the request holds in this group (null blocks not counted)."""
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return 0
        null = self.null_block
        return sum(1 for b in blocks if b is not null)


FullAttentionGroup = GroupManager


class SlidingWindowGroup(GroupManager):
    """A query at position p reads keys ``p - W + 1 .. p``: once a request has computed ``c``
    tokens, the blocks wholly before ``c - W + 1`` are read by no later token and go back to
    the pool (cached ones stay reusable), their places in its table taken by the null block.
    A prefix hit needs only the last ``ceil((W - 1) / block_size)`` blocks before its end."""

    def __init__(self, group_id: int, spec: SlidingWindowSpec, pool: BlockPool,
                 block_size: int, enable_caching: bool) -> None:
        super().__init__(group_id, spec, pool, block_size, enable_caching)
        self.window = spec.sliding_window
        self.needed_blocks = -(-(self.window - 1) // block_size)

    def find_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        null = self.null_block
        need = self.needed_blocks
        if need == 0:  # a window of one token reads nothing cached
            return [null] * max_blocks
        table = self.pool.cached_block_hash_to_block
        tag = self.tag
        hit = [null] * max_blocks
        run = 0
        # From the end: the longest prefix whose last `need` blocks are all cached.
        for i in range(max_blocks - 1, -1, -1):
            b = table.get(hashes[i] + tag)
            if b is None:
                run = 0
                continue
            hit[i] = b
            run += 1
            if run == need:
                return hit[:i + need]
        # A run from the first block serves a prefix shorter than the window.
        return hit[:run]

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        n_skip = (num_computed - self.window + 1) // self.block_size
        blocks = self.req_to_blocks.get(rid)
        if n_skip <= 0 or not blocks:
            return
        null = self.null_block
        freed = []
        for i in range(min(n_skip, len(blocks)) - 1, -1, -1):
            b = blocks[i]
            if b is null:
                break  # the ones before went at an earlier step
            freed.append(b)
            blocks[i] = null
        if freed:
            self.pool.free_blocks(freed)


class RecurrentStateGroup(GroupManager):
    """A fixed-size state per request: one block from admission to the end, whatever the
    request's length. Never prefix-cached (the state after a prefix is not kept)."""

    def find_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        return []

    def num_new_blocks(self, rid: str, num_slots: int, num_hit: int) -> int:
        return 0 if self.req_to_blocks.get(rid) else 1

    def allocate(self, rid: str, num_slots: int) -> list[KVCacheBlock]:
        if self.req_to_blocks.get(rid):
            return []
        new = self.pool.get_new_blocks(1)
        self.req_to_blocks[rid] = list(new)
        return new

    def cache(self, rid: str, hashes: Sequence[bytes], num_full: int) -> None:
        return

    def shrink(self, rid: str, num_tokens: int) -> list[KVCacheBlock]:
        return []


def make_group_manager(group_id: int, spec: KVCacheSpec, pool: BlockPool, block_size: int,
                       enable_caching: bool) -> GroupManager:
    """The manager of one group, by its spec's kind (MLA keeps a row per token, as full
    attention does)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowGroup(group_id, spec, pool, block_size, enable_caching)
    if isinstance(spec, RecurrentStateSpec):
        return RecurrentStateGroup(group_id, spec, pool, block_size, enable_caching)
    return GroupManager(group_id, spec, pool, block_size, enable_caching)
