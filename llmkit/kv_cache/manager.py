"""KVCacheManager: paged KV cache with prefix caching for one KV cache group.

Per request it keeps the list of blocks holding its KV (its block table row) and how many of
its leading blocks are registered in the prefix cache. Full blocks are registered as soon as
they are scheduled to be filled, so a request admitted in the same or a later step can reuse
them; freed cached blocks stay reusable until new allocations evict them, in the order of the
eviction policy (``lru`` or ``lfu``, see ``eviction.py``). The full blocks of pinned prefixes
are never evicted once computed.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

from llmkit.kv_cache.base import KVCacheManagerBase, PrefixCacheStats
from llmkit.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmkit.kv_cache.eviction import make_eviction_policy
from llmkit.kv_cache.hashing import PrefixCacheCounters, extend_block_hashes
from llmkit.kv_cache.integrity import check_pool, count_held
from llmkit.kv_cache.pinned_prefixes import pinned_prefix_hashes

if TYPE_CHECKING:  # the manager reads a Request's attributes; it needs no import at run time
    from llmkit.request import Request

logger = logging.getLogger("llmkit.kv_cache")


class KVCacheManager(KVCacheManagerBase):
    """Paged KV cache manager (vLLM v1 style), registered as ``"paged"``.

    ``max_model_len`` caps the slots a request can reserve (lookahead never reaches beyond it).
    ``eviction_policy`` names the policy that picks which free cached block to evict
    (``lru``, the default, or ``lfu``; see ``EVICTION_POLICIES``). ``pinned_prefixes`` are
    token-id prefixes whose full blocks (hashed with no extra keys: no LoRA, images or salt)
    are never evicted once computed; they must fit in half of the pool.
    """

    #: The useless-block-size detector (see ``_probe_prompt``) compares the first
    #: ``min(block_size - 1, PROBE_TOKENS)`` prompt tokens; it is off below 4 tokens.
    PROBE_TOKENS = 8
    #: It judges after this many distinct requests were looked up ...
    PROBE_MIN_REQUESTS = 32
    #: ... when at least this many of them started like an earlier one and none hit.
    PROBE_MIN_SHARED = 8
    #: It stops watching after this many requests (bounded memory).
    PROBE_MAX_REQUESTS = 1024

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, *, eviction_policy: str = "lru",
                 pinned_prefixes: Sequence[Sequence[int]] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.eviction_policy = eviction_policy
        self.pinned_hashes = pinned_prefix_hashes(pinned_prefixes, num_blocks, block_size,
                                                  enable_prefix_caching)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching,
                                    make_eviction_policy(eviction_policy), self.pinned_hashes)
        # request id -> its blocks in token order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> number of its leading blocks already registered (or found) in the cache
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache stats, counted at admission (see PrefixCacheStats).
        self.prefix_counters = PrefixCacheCounters()
        # The useless-block-size detector: on while it has not decided.
        self._probe_len = min(block_size - 1, self.PROBE_TOKENS)
        self._probe_on = enable_prefix_caching and self._probe_len >= 4
        self._probe_ids: set[str] = set()
        self._probe_starts: set[tuple[int, ...]] = set()
        self._probe_shared = 0

    # -- hashes --------------------------------------------------------------------------
    def ensure_block_hashes(self, request: Request, n: int) -> list[bytes]:
        """The request's block hashes, extended to its first ``n`` full blocks (KV connectors
        key what they keep by them)."""
        return extend_block_hashes(request, n, self.block_size)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks fully covered by its first ``num_tokens`` tokens in the
        prefix cache: after an asynchronous load (``allocate_slots(...,
        delay_cache_blocks=True)``) finished, when their KV is really there."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(rid, 0)
        if num_full > num_cached:
            hashes = extend_block_hashes(request, num_full, self.block_size)
            self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
            self.num_cached_blocks[rid] = num_full

    # -- the scheduler's protocol ---------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks matching the request, and its token count.

        For a request holding no blocks (new, or re-admitted after preemption). At most
        ``(num_tokens - 1) // block_size`` blocks: the last token is always recomputed since
        its logits are needed. The blocks are not yet referenced: pass them to
        ``allocate_slots`` right away, before anything else allocates. The lookup enters the
        prefix-cache stats when that ``allocate_slots`` succeeds (an admission), not here.
        """
        if not self.enable_prefix_caching:
            return [], 0
        if self.req_to_blocks.get(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds blocks; "
                             "get_computed_blocks is for requests being admitted")
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        computed: list[KVCacheBlock] = []
        if max_blocks > 0:
            table = self.block_pool.cached_block_hash_to_block
            hashes = request.block_hashes
            for i in range(max_blocks):
                # Hash lazily: blocks past the first miss are hashed only when they fill.
                h = hashes[i] if i < len(hashes) else extend_block_hashes(request, i + 1, bs)[i]
                block = table.get(h)
                if block is None:
                    break
                computed.append(block)
        num_computed_tokens = len(computed) * bs
        self.prefix_counters.pending = request
        if self._probe_on:
            self._probe_prompt(request, num_computed_tokens)
        return computed, num_computed_tokens

    def _probe_prompt(self, request: Request, num_hit: int) -> None:
        """Warn once when the block size makes prefix caching useless. O(1) per lookup.

        Prompts whose first ``p < block_size`` tokens equal an earlier prompt's share a prefix;
        if, among the first ``PROBE_MIN_REQUESTS`` distinct requests looked up or later, at
        least ``PROBE_MIN_SHARED`` do and no lookup has ever hit a full block, the shared
        prefixes are shorter than a block (or the prompts too short for one shared block):
        whole-block caching cannot reuse them. The first hit turns the detector off for good.
        """
        if num_hit:
            self._probe_stop()
            return
        rid = request.request_id
        ids = self._probe_ids
        if rid in ids:  # a waiting request is looked up again each step; count it once
            return
        ids.add(rid)
        p = self._probe_len
        prompt = request.prompt_token_ids
        if len(prompt) > p:
            start = tuple(prompt[:p])
            if start in self._probe_starts:
                self._probe_shared += 1
            else:
                self._probe_starts.add(start)
        n = len(ids)
        if n >= self.PROBE_MIN_REQUESTS and self._probe_shared >= self.PROBE_MIN_SHARED:
            logger.warning(
                "kv_cache.block_size=%d makes prefix caching useless for this workload: "
                "%d of %d prompts start with the same %d tokens as an earlier prompt, but no "
                "lookup has hit a cached block (only whole blocks of %d tokens are reused). The "
                "shared prefixes look shorter than a block; try a smaller kv_cache.block_size.",
                self.block_size, self._probe_shared, n, p, self.block_size)
            self._probe_stop()
        elif n >= self.PROBE_MAX_REQUESTS:
            self._probe_stop()

    def _probe_stop(self) -> None:
        self._probe_on = False
        self._probe_ids = set()
        self._probe_starts = set()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        *,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens`` tokens; return the newly allocated blocks, or None.

        None means too few free blocks, and then nothing changed (the scheduler may preempt
        and retry). Otherwise the computed blocks (cache hits) are referenced and prepended,
        new blocks appended, and blocks that the computed + new tokens fill completely are
        registered in the prefix cache. Lookahead slots (speculative tokens) are reserved but
        never cached: their tokens are not known yet. If the request was just looked up
        (``get_computed_blocks``), this admission enters the prefix-cache stats with
        ``num_new_computed_tokens`` hit tokens. ``delay_cache_blocks``: the new tokens' KV
        arrives asynchronously (a KV connector's load), so their blocks enter the prefix cache
        only at ``cache_blocks``, once it is there.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"request {request.request_id!r}: negative token count "
                             f"(num_new_tokens={num_new_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens})")
        rid = request.request_id
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks and not new_computed_blocks and not delay_cache_blocks:
            # A running request whose blocks already hold the new slots (most decode steps of
            # the scheduler's running phase): nothing to allocate, at most a filled block to
            # cache. Same result as the general path below, with a fraction of its work.
            num_known = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            if num_known + num_lookahead_tokens <= len(req_blocks) * bs:
                if self.prefix_counters.pending is request:
                    self.prefix_counters.admitted(request, num_new_computed_tokens)
                if self.enable_prefix_caching:
                    self._cache_full_blocks(request, req_blocks, num_known, 0)
                return []
        pool = self.block_pool
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None and num_slots > self.max_model_len:
            num_slots = max(self.max_model_len, num_computed + num_new_tokens)
        num_hit_blocks = len(new_computed_blocks)
        num_new_blocks = -(-num_slots // bs) - num_held - num_hit_blocks
        if num_new_blocks < 0:
            num_new_blocks = 0

        num_evictable_hits = 0
        if num_hit_blocks:
            if num_held:
                raise ValueError(f"request {rid!r} already holds blocks; computed blocks are "
                                 "only given at admission")
            hashes = request.block_hashes
            if num_hit_blocks > len(hashes):
                raise ValueError(f"request {rid!r}: more computed blocks than block hashes")
            for i, b in enumerate(new_computed_blocks):
                if b.block_hash != hashes[i]:
                    # Evicted between get_computed_blocks() and now: its KV is something else.
                    raise ValueError(f"request {rid!r}: computed block {b.block_id} is stale "
                                     "(evicted since get_computed_blocks)")
                if b.ref_cnt == 0 and not b.pinned:
                    num_evictable_hits += 1  # it leaves the free blocks when touched
        num_needed = num_new_blocks + num_evictable_hits
        if num_needed and num_needed > (pool.empty_block_queue.num_free_blocks
                                        + pool.evictor.num_free_blocks):
            return None

        counters = self.prefix_counters
        if counters.pending is request:
            counters.admitted(request, num_new_computed_tokens)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if num_hit_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_prefix_caching and delay_cache_blocks:
            self.num_cached_blocks[rid] = max(self.num_cached_blocks.get(rid, 0), num_hit_blocks)
        elif self.enable_prefix_caching:
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens,
                                    num_hit_blocks)
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock],
                           num_known: int, num_hit_blocks: int) -> None:
        """Cache the request's blocks that ``num_known`` tokens fill (a hit block is cached
        already)."""
        rid = request.request_id
        num_tokens = request.num_tokens
        num_full = (num_known if num_known < num_tokens else num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(rid, 0)
        if num_cached < num_hit_blocks:
            num_cached = num_hit_blocks
        if num_full > num_cached:
            hashes = extend_block_hashes(request, num_full, self.block_size)
            self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
            num_cached = num_full
        self.num_cached_blocks[rid] = num_cached

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix is evicted last."""
        self.prefix_counters.forget(request)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def shrink_slots(self, request: Request, num_tokens: int) -> int:
        """Keep slots for the request's first ``num_tokens`` tokens only: the blocks past them
        (reserved for draft tokens that were rejected) go back to the pool, tail first.
        Returns how many blocks were freed. Those blocks never hold cached content: only full
        blocks of known (accepted) tokens are registered, and every kept token lies before
        them."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = -(-num_tokens // self.block_size)
        if keep >= len(blocks):
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        rid = request.request_id
        if self.num_cached_blocks.get(rid, 0) > keep:
            self.num_cached_blocks[rid] = keep
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) if blocks else 0

    # -- state -----------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of blocks not available for allocation: held by requests, or pinned."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation: empty, or cached and evictable (not pinned)."""
        return self.block_pool.num_free_blocks

    def set_eviction_listener(self, listener: Callable[[list[tuple[int, bytes]]], None]
                              ) -> None:
        self.block_pool.eviction_listener = listener

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        return [(b.block_id, h) for h, b in self.block_pool.cached_block_hash_to_block.items()]

    @property
    def num_prefix_cached_blocks(self) -> int:
        """Blocks that hold a cached full block of some prefix (held by requests or free)."""
        return len(self.block_pool.cached_block_hash_to_block)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks of pinned prefixes computed so far (held or idle); never free again."""
        return self.block_pool.num_pinned_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far (content dropped to reuse the block)."""
        return self.block_pool.num_evictions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_counters.snapshot(self.block_pool.num_evictions)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes but the pinned ones (e.g. after swapping weights); False
        while blocks are held."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Verify ref counts, the free lists (empty blocks and the eviction policy's), pinned
        blocks and the hash table against the requests' blocks.

        O(num_blocks): for tests and debugging, not for every step.
        """
        pool = self.block_pool
        check_pool(pool, count_held(pool, self.req_to_blocks, self.num_cached_blocks))
