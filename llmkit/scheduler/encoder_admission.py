"""Which images a step encodes (vLLM's ``_try_schedule_encoder_inputs``): the scheduler asks
before it gives a multimodal request tokens, and the answer may cut the request's chunk.

An image whose placeholder tokens a step computes must be encoded in that step or already sit
in the encoder cache (``encoder_cache.py``); one that fits neither the step's encoder budget
(``scheduler.max_num_encoder_input_tokens``) nor the cache ends the chunk before its first
placeholder, so an image's encoder run is never split or repeated across steps.

The scheduler turns this feature on with the first request that has images.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmkit.request import Request
from llmkit.scheduler.base import SchedulerOutput, SchedulerStats
from llmkit.scheduler.encoder_cache import EncoderCacheManager
from llmkit.scheduler.hooks import SchedulerFeature


@dataclass(slots=True)
class EncoderInputPlan:
    """A request's images for one step: those to encode, the cached ones it now references
    (indices into ``mm_features``), and the tokens it may compute (the chunk, cut before an
    image that does not fit)."""

    to_encode: list[int]
    hits: list[int]
    num_new_tokens: int


class EncoderAdmission(SchedulerFeature):
    name = "encoder"

    def __init__(self, cache: EncoderCacheManager, max_num_encoder_input_tokens: int) -> None:
        self.cache = cache
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        # The step's image-token budget left, its images to encode, and the plan of the
        # request being scheduled (until it is scheduled or not).
        self._budget = max_num_encoder_input_tokens
        self._inputs: dict[str, list[int]] = {}
        self._plan: tuple[Request, EncoderInputPlan] | None = None

    # -- hooks -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._budget = self.max_num_encoder_input_tokens
        self._inputs = {}
        self._plan = None

    def limit_running(self, req: Request, n: int) -> int:
        return self.limit_admission(req, req.num_computed_tokens, n)

    def limit_admission(self, req: Request, start: int, n: int) -> int:
        """Cut the chunk before an image the encoder cannot take this step (-1: not even one
        token fits, which ends the step's admissions)."""
        if not req.mm_features:
            self._plan = None
            return n
        plan = self.plan(req, start, n, self._budget)
        self._plan = (req, plan)
        return plan.num_new_tokens if plan.num_new_tokens > 0 else -1

    def not_scheduled(self, req: Request) -> None:
        if self._plan is not None and self._plan[0] is req:
            self.release(req, self._plan[1])
        self._plan = None

    def scheduled(self, req: Request, n: int) -> None:
        if self._plan is not None and self._plan[0] is req:
            self._budget -= self.commit(req, self._plan[1], self._inputs)
        self._plan = None

    def preempted(self, req: Request) -> None:
        self.cache.free(req)

    def end_step(self, out: SchedulerOutput) -> None:
        out.scheduled_encoder_inputs = self._inputs
        out.free_encoder_mm_hashes = self.cache.get_freed_mm_hashes()

    def computed(self, req: Request) -> None:
        if req.mm_features:
            self.free_computed(req)

    def finished(self, req: Request, free_blocks: bool) -> bool:
        if req.mm_features:
            self.cache.free(req)
        return free_blocks

    def fill_stats(self, stats: SchedulerStats) -> None:
        # Until the first image arrives (this feature joins then) the cache is untouched and
        # the stats' default (all zero) is its snapshot: text-only steps never make one.
        stats.encoder_cache = self.cache.snapshot()

    def check_request(self, request: Request) -> None:
        """Refuse a request with an image that no step could ever encode."""
        limit = min(self.cache.cache_size, self.max_num_encoder_input_tokens)
        for f in request.mm_features:
            if f.length > limit:
                raise ValueError(
                    f"request {request.request_id!r}: an image of {f.length} tokens exceeds "
                    f"scheduler.encoder_cache_size ({self.cache.cache_size}) or "
                    f"scheduler.max_num_encoder_input_tokens "
                    f"({self.max_num_encoder_input_tokens}); it could never be encoded")

    def plan(self, req: Request, num_computed: int, n: int,
             encoder_budget: int) -> EncoderInputPlan:
        """The images to encode and the cached ones referenced for computing tokens
        ``[num_computed, num_computed + n)`` with ``encoder_budget`` image tokens left this
        step; the cached ones are referenced now (``release`` them if the request does not
        run)."""
        to_encode: list[int] = []
        hits: list[int] = []
        planned: set[str] = set()
        planned_tokens = 0
        cache = self.cache
        for i, f in enumerate(req.mm_features):
            if f.offset >= num_computed + n:
                break
            if f.offset + f.length <= num_computed:
                continue  # its KV is already computed
            if f.identifier in planned:
                continue  # the same image earlier in this prompt: encoded once
            if cache.check_and_update_cache(req, i):
                hits.append(i)
                continue
            if not cache.can_allocate(req, i, encoder_budget - planned_tokens, planned_tokens):
                n = f.offset - num_computed
                break
            to_encode.append(i)
            planned.add(f.identifier)
            planned_tokens += f.length
        return EncoderInputPlan(to_encode, hits, n)

    def release(self, req: Request, plan: EncoderInputPlan) -> None:
        """Drop the references ``plan`` took: the request does not run this step."""
        for i in plan.hits:
            self.cache.free_encoder_input(req, i)

    def commit(self, req: Request, plan: EncoderInputPlan,
               encoder_inputs: dict[str, list[int]]) -> int:
        """Record the images ``req`` encodes this step; their tokens (of the step's budget)."""
        to_encode = plan.to_encode
        cache = self.cache
        # A repeated image in the prompt references the entry its first occurrence makes.
        by_hash = {}
        for i, f in enumerate(req.mm_features):
            by_hash.setdefault(f.identifier, []).append(i)
        used = 0
        for i in to_encode:
            cache.allocate(req, i)
            used += req.mm_features[i].length
            for j in by_hash[req.mm_features[i].identifier]:
                if j > i:
                    cache.check_and_update_cache(req, j)
        if to_encode:
            encoder_inputs[req.request_id] = to_encode
        return used

    def free_computed(self, req: Request) -> None:
        """Unreference the images whose placeholders are all computed now."""
        for i, f in enumerate(req.mm_features):
            if f.offset + f.length <= req.num_computed_tokens:
                self.cache.free_encoder_input(req, i)
