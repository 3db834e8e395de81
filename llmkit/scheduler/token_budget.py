"""The token-budget scheduler: every step hands each request some number of tokens.

There are no phases. Running requests go first (each at least one token, prefill chunks
continue), then waiting requests are admitted in queue order, until the step's token budget,
``max_num_seqs`` or the free KV blocks run out. A prompt larger than the remaining budget is
chunked. When blocks run out for a running request, a victim is preempted (its blocks freed,
its KV recomputed later); prefix caching usually keeps most of its blocks reusable.

Optional features (LoRA slots, draft tokens, EAGLE's prefix rule, images, grammars, a KV
connector) join through the named hooks of ``hooks.py``, registered only while they are on;
the step below walks no code of a feature that is off.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache.base import KVCacheManagerBase
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import (CachedRequestData, NewRequestData, Scheduler,
                                   SchedulerOutput, SchedulerStats)
from llmkit.scheduler.connector_admission import KVConnectorAdmission
from llmkit.scheduler.drafts import DraftTokens, EagleHitTrim
from llmkit.scheduler.encoder_admission import EncoderAdmission
from llmkit.scheduler.encoder_cache import EncoderCacheManager
from llmkit.scheduler.grammar_admission import GrammarAdmission
from llmkit.scheduler.hooks import FeatureHooks, SchedulerFeature
from llmkit.scheduler.lora_slots import LoRASlots
from llmkit.scheduler.step_phases import (WAITING_QUEUES, WaitingQueue, admit_waiting,
                                          apply_step_results, schedule_running, stop_status)

if TYPE_CHECKING:
    from llmkit.kv_transfer.base import KVConnectorBase
    from llmkit.structured_output.manager import StructuredOutputManager

_FINISHED = frozenset(s for s in RequestStatus if s.finished)


class TokenBudgetScheduler(Scheduler):
    supports_lora = True

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManagerBase,
        *,
        max_model_len: int,
        eos_token_id: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int | None = None,
        max_lora_skips: int = 8,
        drop_last_cached_block: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        kv_connector: KVConnectorBase | None = None,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.config = config
        # Pipeline parallel: the engine keeps up to this many batches in flight. Each batch
        # takes at most 1/pp of the running requests (so that decode batches interleave), and
        # carries the tokens it computes for the stages that do not sample.
        self.pipeline_parallel_size = pipeline_parallel_size
        # Requests in a batch whose output has not come back yet: never scheduled again (nor
        # preempted) until it has. Empty between steps of a synchronous engine.
        self.in_flight: set[str] = set()
        self.kv = kv_cache_manager
        self._kv_group_usage = KVGroupUsage(kv_cache_manager)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting = self.make_waiting_queue()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner must drop their state.
        self._finished_req_ids: set[str] = set()
        # Outputs produced outside a step (refused requests), delivered with the next update.
        self.pending_outputs: list[EngineCoreOutput] = []
        self._arrivals = 0
        self.num_preemptions_total = 0
        self._step_preemptions = 0
        self._step_tokens = 0
        self.structured_output_manager = structured_output_manager
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.kv_connector = kv_connector

        self._features: dict[str, SchedulerFeature] = {}
        self.hooks = FeatureHooks(self._features)
        if max_loras is not None:
            self.add_feature(LoRASlots(max_loras, max_lora_skips,
                                        lambda: (self.running, self.waiting)))
        if drop_last_cached_block:
            self.add_feature(EagleHitTrim(kv_cache_manager.block_size))
        if kv_connector is not None:
            self.add_feature(KVConnectorAdmission(kv_connector, kv_cache_manager, self.waiting))

    def make_waiting_queue(self) -> WaitingQueue:
        """The waiting queue (``scheduler.policy``'s order); a subclass may order its own."""
        return WAITING_QUEUES[self.config.policy]()

    def add_feature(self, feature: SchedulerFeature) -> None:
        """Turn ``feature`` on (by its name; it replaces one of the same name)."""
        self._features[feature.name] = feature
        self.hooks = FeatureHooks(self._features)

    # -- intake --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        request.arrival_index = self._arrivals
        self._arrivals += 1
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        if request.mm_features and "encoder" not in self._features:
            self.add_feature(EncoderAdmission(self.encoder_cache,
                                               self.config.max_num_encoder_input_tokens))
        for check in self.hooks.check_request:
            check(request)
        if request.num_prompt_tokens > self.max_model_len:
            # Refuse rather than truncate: the caller learns why through the finish reason.
            request.set_status(RequestStatus.FINISHED_IGNORED)
            request.times.finished = self.clock()
            self.pending_outputs.append(self.make_output(request, []))
            return
        room = self.max_model_len - request.num_prompt_tokens
        request.max_tokens = room if request.max_tokens is None else min(request.max_tokens,
                                                                           max(room, 1))
        if request.use_structured_output and "grammar" not in self._features:
            if self.structured_output_manager is None:
                raise ValueError(f"request {request.request_id!r} asks for structured output, "
                                 "but this scheduler has no structured-output manager")
            self.add_feature(GrammarAdmission(self.structured_output_manager, self))
        self.requests[request.request_id] = request
        if not any(hold(request) for hold in self.hooks.hold_request):
            self.waiting.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            free_blocks: bool | None = True
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
            else:  # held by a feature (a compiling grammar, a loading KV)
                for drop in self.hooks.drop_held:
                    free_blocks = drop(req)
                    if free_blocks is not None:
                        break
            self.finish(req, RequestStatus.FINISHED_ABORTED, free_blocks=free_blocks is not False)
            outs.append(self.make_output(req, []))
        return outs

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        for begin in self.hooks.begin_step:
            begin()
        cfg = self.config
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted_ids: set[str] = set()
        step_budget = cfg.max_num_batched_tokens
        for limit in self.hooks.step_budget:
            step_budget = limit(step_budget)
        budget = schedule_running(self, step_budget, num_scheduled, cached, preempted_ids)
        if not preempted_ids:  # else blocks are scarce: admit nothing this step
            budget = admit_waiting(self, budget, num_scheduled, new_reqs)
        self.in_flight.update(num_scheduled)

        total = step_budget - budget
        self._step_tokens = total
        self._step_preemptions = len(preempted_ids)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted_ids,
        )
        for end in self.hooks.end_step:
            end(out)
        self._finished_req_ids = set()
        return out

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Draft tokens for the next step, per request (a proposer's output); requests not
        named keep none. The first drafts turn draft verification on."""
        if "drafts" not in self._features:
            if not any(draft_token_ids.values()):
                return  # every request has none already
            self.add_feature(DraftTokens(self.kv, self.max_model_len))
        for req in self.running:
            req.spec_token_ids = list(draft_token_ids.get(req.request_id, ()))

    def preempt(self, req: Request) -> None:
        self.kv.free(req)
        for hook in self.hooks.preempted:
            hook(req)
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(req)

    # -- results -------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput, *,
                           step_s: float | None = None) -> list[EngineCoreOutput]:
        return apply_step_results(self, scheduler_output, model_runner_output)

    def check_stop(self, req: Request, tok: int) -> bool:
        """Apply stop conditions after ``tok`` was appended; finish the request if one holds."""
        status = stop_status(req, tok, self.max_model_len)
        if status is None:
            return False
        self.finish(req, status)
        return True

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """End ``req`` (its blocks freed unless a feature keeps them)."""
        req.set_status(status)
        req.times.finished = self.clock()
        for hook in self.hooks.finished:
            free_blocks = hook(req, free_blocks)
        if free_blocks:
            self.kv.free(req)
        self._finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def report_finished(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` outside a step's results: its output goes with the next update."""
        self.finish(req, status)
        self.pending_outputs.append(self.make_output(req, []))

    def make_output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        if req.status in _FINISHED:
            for hook in self.hooks.final_output:
                hook(req, out)
        return out

    # -- introspection -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        # Held blocks of finished requests keep the engine stepping: their transfers end in a
        # step's connector output.
        return (bool(self.requests) or bool(self.pending_outputs)
                or any(h() for h in self.hooks.holds_work))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def unfinished_requests(self) -> Iterable[Request]:
        return list(self.requests.values())

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(h() for h in self.hooks.num_held),
            kv_usage=self.kv.usage,
            kv_usage_by_group=self._kv_group_usage(),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            step_num_scheduled_tokens=self._step_tokens,
            step_num_preemptions=self._step_preemptions,
        )
        for fill in self.hooks.fill_stats:
            fill(stats)
        return stats


# -- the stats' per-group KV usage ---------------------------------------------------------
# Per KV-cache group usage for the stats snapshot (``SchedulerStats.kv_usage_by_group``).
#
# The manager's ``kv_usage_by_group()`` maps each group (``"<index>:<spec>"``, e.g. ``"0:full"``)
# to the fraction of the pool its requests hold. With one group that is the pool's usage (O(1));
# with several it walks the blocks held, so it is recomputed at most every
# ``MIN_INTERVAL_S`` of wall time (and whenever the pool holds nothing) and the last figures are
# reported in between: the snapshot is made every step, its readers (``/metrics``, the engine
# page) look a few times a second.
MIN_INTERVAL_S = 0.25


class KVGroupUsage:
    def __init__(self, kv: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self._last: dict[str, float] = {}
        self._at = -float("inf")

    def __call__(self) -> dict[str, float]:
        kv = self.kv
        by_group = kv.kv_usage_by_group
        if kv.num_groups <= 1:
            return by_group()
        now = self.clock()
        # An empty pool is walked at once (nothing to walk): the step that frees the last
        # request's blocks is often the engine's last before it idles, and a throttled figure
        # would then show the groups holding blocks on /metrics and the engine page for good.
        if now - self._at >= MIN_INTERVAL_S or kv.usage == 0.0:
            self._last, self._at = by_group(), now
        return dict(self._last)
