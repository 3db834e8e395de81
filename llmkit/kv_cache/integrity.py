"""The shared parts of ``check_integrity()``: what the requests of one block table hold
(:func:`count_held`), and the pool-side half, ref counts against what the requests hold, the
free lists, pinned blocks and the hash table (:func:`check_pool`). Every manager over a
``BlockPool`` (one group or several) counts what each of its tables holds, adds the checks of
its own kind, and calls :func:`check_pool`."""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from llmkit.kv_cache.base import KVCacheIntegrityError
from llmkit.kv_cache.block_pool import BlockPool, KVCacheBlock


def count_held(pool: BlockPool, req_to_blocks: Mapping[str, Sequence[KVCacheBlock]],
               num_cached: Mapping[str, int], where: str = "") -> Counter[int]:
    """The references per block id that the requests of one block table hold (the pool's null
    block left out); raise :class:`KVCacheIntegrityError` if a request holds a block twice or
    one not of this pool, or counts more cached blocks than it holds, or cached blocks without
    holding any. ``where`` starts every message (which table)."""
    blocks = pool.blocks
    null = pool.null_block

    def fail(msg: str) -> None:
        raise KVCacheIntegrityError(where + msg)

    refs: Counter[int] = Counter()
    for rid, req_blocks in req_to_blocks.items():
        held = [b for b in req_blocks if b is not null]
        ids = [b.block_id for b in held]
        if len(set(ids)) != len(ids):
            fail(f"request {rid!r} holds a block twice: {ids}")
        for b in held:
            if not (0 <= b.block_id < len(blocks)) or blocks[b.block_id] is not b:
                fail(f"request {rid!r} holds {b!r}, which is not a block of this pool")
        refs.update(ids)
        n_cached = num_cached.get(rid, 0)
        if n_cached > len(req_blocks):
            fail(f"request {rid!r}: {n_cached} cached blocks but holds {len(req_blocks)}")
    for rid in num_cached:
        if rid not in req_to_blocks:
            fail(f"request {rid!r} has a cached-block count but no blocks")
    return refs


def check_pool(pool: BlockPool, refs: Counter[int]) -> None:
    """Raise :class:`KVCacheIntegrityError` unless every block's ``ref_cnt`` equals
    ``refs[block_id]`` (the references live requests hold) and the free lists, pinned blocks
    and hash table agree with the blocks. O(num_blocks). The pool's null block, if any, is
    never held, free nor cached."""
    blocks = pool.blocks

    def fail(msg: str) -> None:
        raise KVCacheIntegrityError(msg)

    null = pool.null_block
    for b in blocks:
        if b is null:
            if b.ref_cnt or b.block_hash is not None or b.prev_free or b.next_free:
                fail(f"the null block {b!r} was allocated, cached or freed")
            if b.block_id in refs:
                fail(f"the null block {b.block_id} is counted as held by a request")
            continue
        if b.ref_cnt != refs.get(b.block_id, 0):
            fail(f"block {b.block_id}: ref_cnt={b.ref_cnt} but "
                 f"{refs.get(b.block_id, 0)} live requests hold it")

    # Free lists: every block with ref_cnt 0 is in exactly one of them, or pinned and idle.
    nb = len(blocks)
    where: dict[int, str] = {}

    def check_free(b: KVCacheBlock, name: str) -> None:
        if not (0 <= b.block_id < nb) or blocks[b.block_id] is not b:
            fail(f"{name}: {b!r} is not a block of this pool")
        if b.block_id in where:
            fail(f"{name}: block {b.block_id} appears twice (also in {where[b.block_id]})")
        if b.ref_cnt != 0:
            fail(f"{name}: block {b.block_id} has ref_cnt={b.ref_cnt}")
        if b.block_id in refs:
            fail(f"{name}: block {b.block_id} is held by a request")
        if b.pinned:
            fail(f"{name}: block {b.block_id} is pinned, so never free")
        where[b.block_id] = name

    empty_name = "free queue (empty blocks)"
    pool.empty_block_queue.check_links(empty_name)
    for b in pool.empty_block_queue:
        check_free(b, empty_name)
        if b.block_hash is not None:
            fail(f"{empty_name}: block {b.block_id} holds cached content (hash set)")
    evictor = pool.evictor
    evict_name = f"free queue (cached blocks, {type(evictor).__name__})"
    evictor.check()
    n_evictable = 0
    for b in evictor:
        n_evictable += 1
        if n_evictable > nb:
            fail(f"{evict_name}: longer than the pool (cycle)")
        check_free(b, evict_name)
        if b.block_hash is None:
            fail(f"{evict_name}: block {b.block_id} has no hash, so nothing to keep")
    if n_evictable != evictor.num_free_blocks:
        fail(f"{evict_name}: {n_evictable} blocks but num_free_blocks="
             f"{evictor.num_free_blocks}")
    n_pinned = 0
    for b in blocks:
        n_pinned += b.pinned
        if b.ref_cnt == 0 and b.block_id not in where and not b.pinned and b is not null:
            fail(f"block {b.block_id} has ref_cnt=0 but is in no free list")
        if b.block_id not in where and (b.prev_free is not None or b.next_free is not None):
            fail(f"block {b.block_id} is not free but still has free-list links")
    if n_pinned != pool.num_pinned_blocks:
        fail(f"{n_pinned} blocks are pinned but num_pinned_blocks={pool.num_pinned_blocks}")

    table = pool.cached_block_hash_to_block
    pinned_hashes = pool.pinned_hashes
    for h, b in table.items():
        if b.block_hash != h:
            fail(f"hash table: {h.hex()} maps to block {b.block_id} whose hash is "
                 f"{b.block_hash.hex() if b.block_hash else None}")
        if (h in pinned_hashes) != b.pinned:
            fail(f"block {b.block_id}: pinned={b.pinned} but its hash is "
                 f"{'' if h in pinned_hashes else 'not '}a pinned prefix's")
    for b in blocks:
        if b.block_hash is not None and table.get(b.block_hash) is not b:
            fail(f"block {b.block_id} has a hash but is not registered under it")
        if b.pinned and b.block_hash is None:
            fail(f"block {b.block_id} is pinned but holds no cached content")
