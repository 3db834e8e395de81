"""The prefix-cache counters of :class:`~llmkit.kv_cache.base.PrefixCacheStats`, kept the same
way by every manager over a ``BlockPool`` (one KV-cache group or several): a lookup counts once
the request it was for is admitted, not when it is made."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.kv_cache.base import PrefixCacheStats

if TYPE_CHECKING:
    from llmkit.request import Request


class PrefixCacheCounters:
    """Admissions, tokens looked up and tokens hit, with the share of re-admissions after
    preemption.

    The manager's protocol: ``get_computed_blocks`` sets ``pending`` to the request it looked
    up; ``allocate_slots`` calls :meth:`admitted` when it succeeds for that request (testing
    ``pending is request`` itself: it runs for every request every step, so no call there
    when nothing is pending); ``free`` calls :meth:`forget`.
    """

    __slots__ = ("pending", "requests", "queries", "hits", "preempted_requests",
                 "preempted_queries", "preempted_hits")

    def __init__(self) -> None:
        #: The request whose lookup is not counted yet (looked up, not yet admitted).
        self.pending: Request | None = None
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def admitted(self, request: Request, num_hit: int) -> None:
        """Count the pending lookup: ``request`` was admitted with ``num_hit`` cached tokens."""
        self.pending = None
        n = request.num_tokens
        self.requests += 1
        self.queries += n
        self.hits += num_hit
        if request.num_preemptions:
            self.preempted_requests += 1
            self.preempted_queries += n
            self.preempted_hits += num_hit

    def forget(self, request: Request) -> None:
        """Drop ``request``'s pending lookup (it leaves without being admitted)."""
        if self.pending is request:
            self.pending = None

    def snapshot(self, evictions: int) -> PrefixCacheStats:
        """The counters so far, with the pool's ``evictions``."""
        return PrefixCacheStats(requests=self.requests, queries=self.queries, hits=self.hits,
                                evictions=evictions,
                                preempted_requests=self.preempted_requests,
                                preempted_queries=self.preempted_queries,
                                preempted_hits=self.preempted_hits)
