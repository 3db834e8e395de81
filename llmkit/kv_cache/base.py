"""The KV cache manager interface the scheduler talks to, and its plain data."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec

if TYPE_CHECKING:
    from llmkit.kv_cache.block_pool import KVCacheBlock
    from llmkit.request import Request


class KVCacheIntegrityError(AssertionError):
    """The manager's bookkeeping is inconsistent (ref counts, free list, hash table).

    Raised by ``check_integrity()``; the message names the block or request and what is wrong.
    """


class PrefixCacheStats(msgspec.Struct):
    """Prefix-cache counters: cumulative from ``prefix_cache_stats``, since the previous call
    from ``take_step_stats()``.

    Counted at every admission (as vLLM's v1 scheduler counts): a lookup
    (``get_computed_blocks``) counts once the request it was for is admitted, i.e. its
    ``allocate_slots`` succeeds; a waiting request that is looked up but gets no blocks this
    step is not counted (it is looked up again, and counted, when it is admitted). A request
    re-admitted after preemption counts again; the ``preempted_*`` fields are that share.
    Requests that skip the lookup (prompt logprobs) are not counted.

    - ``requests``: admissions that looked up the cache.
    - ``queries``: tokens looked up, i.e. the sum of ``request.num_tokens`` over them.
    - ``hits``: tokens served from the cache, i.e. the sum of the computed tokens admitted with.
    - ``preempted_requests`` / ``preempted_queries`` / ``preempted_hits``: the part of the
      three above from re-admissions after preemption (vLLM keeps these apart; its logged hit
      rate is ``(hits - preempted_hits) / (queries - preempted_queries)``).
    - ``evictions``: cached blocks whose content was dropped to reuse the block for new
      tokens (``reset_prefix_cache()`` is not counted).
    - ``hit_rate``: ``hits / queries`` (0.0 before any query). At most
      ``(num_tokens - 1) / num_tokens`` per request: the last token is always recomputed.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManagerBase(ABC):
    """Hands out KV cache blocks to requests and finds reusable (prefix-cached) ones.

    The scheduler's protocol, per request and step:
    1. each time a request holding no blocks is tried for admission:
       ``blocks, n = get_computed_blocks(req)``;
    2. right after, ``allocate_slots(req, num_new_tokens, num_lookahead_tokens,
       new_computed_blocks=blocks, num_new_computed_tokens=n)``; ``None`` means "not enough
       free blocks, nothing changed" (and the lookup is not counted in the stats);
    3. ``shrink_slots(req, n)`` when draft tokens were rejected: only ``n`` tokens' slots stay;
    4. ``free(req)`` when it finishes, is aborted or is preempted.
    """

    # take_step_stats' previous snapshot (a class default: subclasses need not call __init__)
    _last_step_stats: PrefixCacheStats | None = None

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    #: KV-cache groups (``llmkit.kv_cache.groups``), one block table each. A manager of
    #: several (``HybridKVCacheManager``) hands out one list of blocks (and ids) per group
    #: and has ``block_ids_update``; every other manager serves one.
    num_groups: int = 1
    #: Whether block ids travel per group (tuples of lists): the hybrid manager's protocol,
    #: also with one group (a model whose every layer slides).
    grouped_block_ids: bool = False
    #: Whether a request refused blocks for a long prefill chunk may still get them for a
    #: shorter one even with nothing else running: a sliding-window group holds the blocks of
    #: its window plus the chunk, and frees the rest as the prompt advances.
    smaller_chunks_may_fit: bool = False
    #: The one group's spec in words (``groups.spec_label``), for per-group metrics.
    group_label: str = "full"

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks and the number of tokens it covers."""

    @abstractmethod
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
        """Ensure slots for the request's next tokens; the newly allocated blocks, or None.
        ``delay_cache_blocks``: do not enter the new blocks in the prefix cache yet (their KV
        loads asynchronously; ``cache_blocks`` enters them)."""

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks covered by its first ``num_tokens`` tokens in the prefix
        cache (after a delayed, asynchronous load). Needed by KV connectors."""
        raise NotImplementedError(f"{type(self).__name__} does not support KV connectors")

    def ensure_block_hashes(self, request: Request, n: int) -> list[bytes]:
        """The request's first ``n`` block hashes (computed as needed). Needed by KV
        connectors."""
        raise NotImplementedError(f"{type(self).__name__} does not support KV connectors")

    def set_eviction_listener(self, listener: "Callable[[list[tuple[int, bytes]]], None]"
                              ) -> None:
        """Call ``listener`` with the ``(block_id, block_hash)`` of cached blocks as they are
        evicted. Needed by KV connectors."""
        raise NotImplementedError(f"{type(self).__name__} does not support KV connectors")

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """Every cached full block as ``(block_id, block_hash)`` (a KV connector's last hand-off
        at shutdown). Needed by KV connectors."""
        raise NotImplementedError(f"{type(self).__name__} does not support KV connectors")

    @property
    def num_prefix_cached_blocks(self) -> int:
        """Blocks that hold a cached full block of some prefix (0 without a prefix cache)."""
        return 0

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release every block the request holds; safe to call twice."""

    @abstractmethod
    def shrink_slots(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks past the request's first ``num_tokens`` tokens (the slots of
        rejected draft tokens); the number of blocks freed."""

    @abstractmethod
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks the request holds, in token order."""

    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[int]:
        """The ids of the blocks the request holds, in token order (its block table row)."""

    def num_blocks_held(self, request_id: str) -> int:
        """How many blocks the request holds (the scheduler asks every step)."""
        return len(self.get_block_ids(request_id))

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks not available for allocation (held by requests, or pinned), in
        [0, 1]."""

    def kv_usage_by_group(self) -> dict[str, float]:
        """Per KV-cache group (``"<index>:<spec>"``, e.g. ``"0:full"``), the fraction of the
        pool its requests hold."""
        return {f"0:{self.group_label}": self.usage}

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks available for allocation: not held by any request (cached or not) and not
        pinned."""

    @property
    @abstractmethod
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative prefix-cache counters."""

    def take_step_stats(self) -> PrefixCacheStats:
        """The prefix-cache counters since the previous call (or since start-up), for per-step
        metrics. O(1): the difference of two snapshots of ``prefix_cache_stats``."""
        now = self.prefix_cache_stats
        last = self._last_step_stats or PrefixCacheStats()
        self._last_step_stats = now
        return PrefixCacheStats(
            requests=now.requests - last.requests, queries=now.queries - last.queries,
            hits=now.hits - last.hits, evictions=now.evictions - last.evictions,
            preempted_requests=now.preempted_requests - last.preempted_requests,
            preempted_queries=now.preempted_queries - last.preempted_queries,
            preempted_hits=now.preempted_hits - last.preempted_hits)

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (pinned prefixes excepted); refuses (False) while any
        block is held."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise :class:`KVCacheIntegrityError` if the bookkeeping is inconsistent."""
