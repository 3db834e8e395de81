"""Which images a step encodes (vLLM's ``_try_schedule_encoder_inputs``): the scheduler asks
before it gives a multimodal request tokens, and the answer may cut the request's chunk.

An image whose placeholder tokens a step computes must be encoded in that step or already sit
in the encoder cache (``encoder_cache.py``); one that fits neither the step's encoder budget
(``scheduler.max_num_encoder_input_tokens``) nor the cache ends the chunk before its first
placeholder, so an image's encoder run is never split or repeated across steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmkit.request import Request
from llmkit.scheduler.encoder_cache import EncoderCacheManager


@dataclass(slots=True)
class EncoderInputPlan:
    """A request's images for one step: those to encode, the cached ones it now references
    (indices into ``mm_features``), and the tokens it may compute (the chunk, cut before an
    image that does not fit)."""

    to_encode: list[int]
    hits: list[int]
    num_new_tokens: int


class EncoderAdmission:
    def __init__(self, cache: EncoderCacheManager, max_num_encoder_input_tokens: int) -> None:
        self.cache = cache
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens

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
