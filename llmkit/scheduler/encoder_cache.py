"""The encoder cache's bookkeeping (vLLM's ``EncoderCacheManager``): which images' encoder
outputs the runner holds, keyed by the image's content hash, and how many image tokens they
take of ``scheduler.encoder_cache_size``.

An entry is *referenced* while some request still has placeholder tokens of that image to
compute; once none has, it stays cached but may be evicted (least recently freed first) to make
room. A request that brings a cached image again takes a reference and is not encoded again.
The scheduler tells the runner which hashes were evicted (``SchedulerOutput.
free_encoder_mm_hashes``); the runner drops their tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmkit.request import Request


@dataclass(slots=True)
class EncoderCacheStats:
    """Counters since start-up: lookups of images not computed yet, lookups answered from the
    cache, images encoded (encoder runs), and image tokens cached now."""

    queries: int = 0
    hits: int = 0
    num_encoder_runs: int = 0
    num_cached_tokens: int = 0


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # not taken by any entry
        self.num_freeable_slots = cache_size  # free + held by unreferenced entries
        # content hash -> (request id, input index) of the placeholders that still need it
        self.cached: dict[str, set[tuple[str, int]]] = {}
        self.sizes: dict[str, int] = {}
        # unreferenced entries, oldest first: evicted in this order
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self._freed: list[str] = []
        self.stats = EncoderCacheStats()

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True when the image is cached (or scheduled this step): ``request`` now holds a
        reference to it."""
        h = request.mm_features[input_id].identifier
        self.stats.queries += 1
        refs = self.cached.get(h)
        if refs is None:
            return False
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(h)
        refs.add((request.request_id, input_id))
        self.stats.hits += 1
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_budget: int,
                     num_tokens_to_schedule: int) -> bool:
        """Whether the image fits this step's encoder budget and the cache (with
        ``num_tokens_to_schedule`` image tokens already planned this step), evicting
        unreferenced entries as needed."""
        n = request.mm_features[input_id].length
        if n > encoder_budget:
            return False
        need = n + num_tokens_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            h, size = self.freeable.popitem(last=False)
            del self.cached[h], self.sizes[h]
            self._freed.append(h)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        f = request.mm_features[input_id]
        self.cached.setdefault(f.identifier, set()).add((request.request_id, input_id))
        self.sizes[f.identifier] = f.length
        self.num_free_slots -= f.length
        self.num_freeable_slots -= f.length
        self.stats.num_encoder_runs += 1

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """``request`` no longer needs the image (its tokens are computed): unreference it."""
        h = request.mm_features[input_id].identifier
        refs = self.cached.get(h)
        key = (request.request_id, input_id)
        if refs is None or key not in refs:
            return
        refs.discard(key)
        if not refs:
            size = self.sizes[h]
            self.freeable[h] = size
            self.num_freeable_slots += size

    def free(self, request: Request) -> None:
        """Drop every reference of ``request`` (it finished or was preempted)."""
        for i in range(len(request.mm_features)):
            self.free_encoder_input(request, i)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def snapshot(self) -> EncoderCacheStats:
        s = self.stats
        return EncoderCacheStats(s.queries, s.hits, s.num_encoder_runs,
                                 self.cache_size - self.num_free_slots)
