"""Speculative decoding's part in scheduling: a decoding request verifies its draft tokens in
the step that computes its next token, and the slots of rejected drafts go back afterwards.
EAGLE adds a prefix-cache rule (``EagleHitTrim``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.kv_cache.base import KVCacheManagerBase
from llmkit.request import Request
from llmkit.scheduler.base import SchedulerOutput, SchedulerStats, SpecDecodeStats
from llmkit.scheduler.hooks import SchedulerFeature

if TYPE_CHECKING:
    from llmkit.kv_cache.block_pool import KVCacheBlock
    from llmkit.outputs import ModelRunnerOutput


class DraftTokens(SchedulerFeature):
    """Turned on by the first drafts a proposer hands the scheduler."""

    name = "drafts"

    def __init__(self, kv_cache_manager: KVCacheManagerBase, max_model_len: int) -> None:
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()  # since start-up
        self.step_stats = SpecDecodeStats()  # the latest step's
        self._step_drafts: dict[str, list[int]] = {}
        # The drafts extra_tokens granted, until the request is scheduled (or not).
        self._req: Request | None = None
        self._drafts: list[int] = []

    def begin_step(self) -> None:
        self._step_drafts = {}

    def extra_tokens(self, req: Request, n: int, budget: int) -> int:
        """Only while it decodes (one new token), within the budget and within max_model_len
        / max_tokens (tokens past either could never be kept)."""
        drafts = req.spec_token_ids
        if not drafts or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
            self._req = None
            return 0
        room = min(budget - 1, self.max_model_len - req.num_tokens,
                   req.max_tokens - req.num_output_tokens - 1)
        self._req, self._drafts = req, drafts[:max(room, 0)]
        return len(self._drafts)

    def not_scheduled(self, req: Request) -> None:
        self._req = None

    def scheduled(self, req: Request, n: int) -> None:
        req.spec_token_ids = []  # drafts are verified once (or dropped with the step)
        if self._req is req:
            self._req = None
            if self._drafts:
                self._step_drafts[req.request_id] = self._drafts

    def preempted(self, req: Request) -> None:
        req.spec_token_ids = []

    def end_step(self, out: SchedulerOutput) -> None:
        out.scheduled_spec_tokens = self._step_drafts

    def begin_update(self, runner_output: ModelRunnerOutput) -> None:
        self.step_stats = SpecDecodeStats()

    def verify(self, req: Request, new_tokens: list[int], out: SchedulerOutput) -> None:
        drafts = out.scheduled_spec_tokens.get(req.request_id)
        if not drafts:
            return
        # 1 + K tokens were computed; the KV of the rejected drafts' positions is garbage:
        # those tokens are no longer computed, and their slots go back.
        num_rejected = len(drafts) + 1 - len(new_tokens)
        req.num_computed_tokens -= num_rejected
        req.spec_token_ids = []
        if num_rejected:
            self.kv.shrink_slots(req, req.num_computed_tokens)
        self.stats.observe(len(drafts), len(new_tokens) - 1)
        self.step_stats.observe(len(drafts), len(new_tokens) - 1)

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.spec_decode = self.stats.snapshot()
        stats.step_spec_decode = self.step_stats.snapshot()


class EagleHitTrim(SchedulerFeature):
    """A prefix-cache hit leaves its last block to be recomputed: EAGLE's head's KV at a
    position depends on the token after it, which only a matching next block fixes."""

    name = "eagle"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def trim_prefix_hit(self, blocks: list[KVCacheBlock], num_hit: int
                        ) -> tuple[list[KVCacheBlock], int]:
        if blocks:
            return blocks[:-1], num_hit - self.block_size
        return blocks, num_hit
