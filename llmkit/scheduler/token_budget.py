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
from typing import TYPE_CHECKING, Callable, Iterable

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
from llmkit.scheduler.hooks import ADMIT, PASS_OVER_AND_STOP, FeatureHooks, SchedulerFeature
from llmkit.scheduler.lora_slots import LoRASlots
from llmkit.scheduler.policies import WAITING_QUEUES, pick_victim
from llmkit.scheduler.stop_checks import stop_status

if TYPE_CHECKING:
    from llmkit.kv_transfer.base import KVConnectorBase
    from llmkit.structured_output.manager import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
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
        self._in_flight: set[str] = set()
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting = WAITING_QUEUES[config.policy]()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner must drop their state.
        self._finished_req_ids: set[str] = set()
        # Outputs produced outside a step (refused requests), delivered with the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
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
            self._add_feature(LoRASlots(max_loras, max_lora_skips,
                                        lambda: (self.running, self.waiting)))
        if drop_last_cached_block:
            self._add_feature(EagleHitTrim(kv_cache_manager.block_size))
        if kv_connector is not None:
            self._add_feature(KVConnectorAdmission(kv_connector, kv_cache_manager, self.waiting))

    def _add_feature(self, feature: SchedulerFeature) -> None:
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
            self._add_feature(EncoderAdmission(self.encoder_cache,
                                               self.config.max_num_encoder_input_tokens))
        for check in self.hooks.check_request:
            check(request)
        if request.num_prompt_tokens > self.max_model_len:
            # Refuse rather than truncate: the caller learns why through the finish reason.
            request.set_status(RequestStatus.FINISHED_IGNORED)
            request.times.finished = self.clock()
            self._pending_outputs.append(self._output(request, []))
            return
        room = self.max_model_len - request.num_prompt_tokens
        request.max_tokens = room if request.max_tokens is None else min(request.max_tokens,
                                                                           max(room, 1))
        if request.use_structured_output and "grammar" not in self._features:
            if self.structured_output_manager is None:
                raise ValueError(f"request {request.request_id!r} asks for structured output, "
                                 "but this scheduler has no structured-output manager")
            self._add_feature(GrammarAdmission(self.structured_output_manager, self))
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
            outs.append(self._output(req, []))
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
        budget = self._schedule_running(cfg.max_num_batched_tokens, num_scheduled, cached,
                                        preempted_ids)
        if not preempted_ids:  # else blocks are scarce: admit nothing this step
            budget = self._admit_waiting(budget, num_scheduled, new_reqs)
        self._in_flight.update(num_scheduled)

        total = cfg.max_num_batched_tokens - budget
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

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          cached: CachedRequestData, preempted_ids: set[str]) -> int:
        """Running requests, in admission order: each continues its prefill or decodes. The
        step's tokens count as computed from here on: the next schedule() builds on them.
        Returns the budget left."""
        hooks = self.hooks
        limit, extra = hooks.limit_running, hooks.extra_tokens
        scheduled_hooks, not_scheduled = hooks.scheduled, hooks.not_scheduled
        kv = self.kv
        allocate, num_blocks_held = kv.allocate_slots, kv.num_blocks_held
        lookahead = self.config.num_lookahead_tokens
        long_prefill = self.config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        pp = self.pipeline_parallel_size
        in_flight = self._in_flight
        running = self.running
        max_running = -(-len(running) // pp) if pp > 1 else len(running)
        c_ids, c_blocks = cached.req_ids, cached.new_block_ids
        c_computed, c_offsets = cached.num_computed_tokens, cached.block_ids_offset
        num_running = 0
        i = 0
        while i < len(running) and budget > 0 and num_running < max_running:
            req = running[i]
            rid = req.request_id
            if in_flight and rid in in_flight:
                i += 1
                continue
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) - computed
            if long_prefill and n > long_prefill:
                n = long_prefill
            if n > budget:
                n = budget
            if n > max_model_len - computed:
                n = max_model_len - computed
            for lim in limit:
                if n <= 0:
                    break
                n = lim(req, n)
            if n <= 0:
                i += 1
                continue
            for ext in extra:
                n += ext(req, n, budget)
            new_blocks = allocate(req, n, lookahead)
            if new_blocks is None:
                new_blocks = self._make_room(req, n, lookahead, i, preempted_ids)
                if new_blocks is None:
                    for hook in not_scheduled:
                        hook(req)
                    continue  # req itself was preempted; `i` already points at the next one
            num_scheduled[rid] = n
            budget -= n
            for hook in scheduled_hooks:
                hook(req, n)
            c_ids.append(rid)
            c_blocks.append([b.block_id for b in new_blocks] if new_blocks else [])
            c_computed.append(computed)
            c_offsets.append(num_blocks_held(rid) - len(new_blocks))
            if pp > 1:
                cached.new_token_ids.append(req.all_token_ids[computed:computed + n])
            req.num_computed_tokens = computed + n
            num_running += 1
            i += 1
        return budget

    def _make_room(self, req: Request, n: int, lookahead: int, i: int,
                   preempted_ids: set[str]) -> list | None:
        """Preempt running requests not yet scheduled this step (nor in flight), last first,
        until ``req``'s slots fit; None if ``req`` itself went (preempted, or alone and still
        out of blocks)."""
        running = self.running
        in_flight = self._in_flight
        while True:
            if len(running) == 1:
                # Alone and still out of blocks: the request has outgrown the whole pool.
                # Preempting it would only re-admit it to grow again (a livelock), so it
                # ends here, capped by KV capacity as it would be by max_model_len.
                running.pop()
                self.report_finished(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                return None
            victim = pick_victim([r for r in running[i:] if r.request_id not in in_flight],
                                 self.config.preemption_policy)
            running.remove(victim)
            self._preempt(victim)
            preempted_ids.add(victim.request_id)
            if victim is req:
                return None
            new_blocks = self.kv.allocate_slots(req, n, lookahead)
            if new_blocks is not None:
                return new_blocks

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[NewRequestData]) -> int:
        """Waiting requests, in queue order, while the budget, max_num_seqs and the blocks
        last. Returns the budget left."""
        hooks = self.hooks
        cfg, kv, waiting, running = self.config, self.kv, self.waiting, self.running
        skipped: list[Request] = []
        while len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting.peek()
            verdict = ADMIT
            for pass_over in hooks.pass_over:
                verdict = pass_over(req)
                if verdict != ADMIT:
                    break
            if verdict != ADMIT:
                skipped.append(waiting.pop())
                if verdict == PASS_OVER_AND_STOP:
                    break
                continue
            loaded = any(holds(req) for holds in hooks.holds_kv)
            lookup = not loaded and (req.sampling_params.prompt_logprobs is None
                                     or req.num_output_tokens)
            num_ext, load_async = 0, False
            if lookup:
                computed_blocks, num_hit = kv.get_computed_blocks(req)
                for trim in hooks.trim_prefix_hit:
                    computed_blocks, num_hit = trim(computed_blocks, num_hit)
                for match in hooks.match_external:
                    num_ext, load_async = match(req, num_hit)
            else:
                # Cached positions have no logits: a request that still owes its prompt
                # logprobs computes its whole prompt (as vLLM does). Its blocks are still
                # cached for other requests by allocate_slots.
                computed_blocks, num_hit = [], 0
            start = req.num_computed_tokens if loaded else num_hit + num_ext
            n = req.num_tokens - start
            if load_async:
                n = 0  # nothing runs until the KV is here
            elif n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            if not load_async:
                for lim in hooks.limit_admission:
                    n = lim(req, start, n)
                    if n < 0:
                        break
                if n < 0:  # e.g. the first image the encoder cannot take this step
                    for hook in hooks.not_scheduled:
                        hook(req)
                    break
            new_blocks = kv.allocate_slots(req, n + num_ext, cfg.num_lookahead_tokens,
                                           new_computed_blocks=computed_blocks,
                                           num_new_computed_tokens=num_hit,
                                           delay_cache_blocks=load_async)
            if new_blocks is None:
                for hook in hooks.not_scheduled:
                    hook(req)
                if not running and not num_scheduled and not any(b() for b in hooks.busy):
                    # Nothing runs that could free blocks: this request can never fit.
                    waiting.pop()
                    self._refuse(req)
                    continue
                break
            waiting.pop()
            if any(park(req, lookup, num_hit, num_ext, load_async) for park in hooks.parked):
                continue
            for hook in hooks.admitted:
                hook(req)
            req.set_status(RequestStatus.RUNNING)
            if not loaded:
                req.num_computed_tokens = num_hit + num_ext
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            if req.times.first_scheduled is None:
                req.times.first_scheduled = self.clock()
            running.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            for hook in hooks.scheduled:
                hook(req, n)
            new_reqs.append(NewRequestData(
                req_id=req.request_id,
                token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params,
                block_ids=kv.get_block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens,
                eos_token_id=req.eos_token_id,
                lora_id=req.lora_id,
                mm_features=req.mm_features,
            ))
            req.num_computed_tokens += n
        for req in reversed(skipped):  # back in their places, ahead of what came after
            waiting.add_preempted(req)
        return budget

    def _refuse(self, req: Request) -> None:
        self.report_finished(req, RequestStatus.FINISHED_ABORTED
                             if req.status == RequestStatus.PREEMPTED
                             else RequestStatus.FINISHED_IGNORED)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Draft tokens for the next step, per request (a proposer's output); requests not
        named keep none. The first drafts turn draft verification on."""
        if "drafts" not in self._features:
            if not any(draft_token_ids.values()):
                return  # every request has none already
            self._add_feature(DraftTokens(self.kv, self.max_model_len))
        for req in self.running:
            req.spec_token_ids = list(draft_token_ids.get(req.request_id, ()))

    def _preempt(self, req: Request) -> None:
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
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        hooks = self.hooks
        outputs, self._pending_outputs = self._pending_outputs, []
        for begin in hooks.begin_update:
            begin(model_runner_output)
        computed_hooks, verify, accept = hooks.computed, hooks.verify, hooks.accept_tokens
        now = self.clock()
        sampled = model_runner_output.sampled_token_ids
        index = {rid: i for i, rid in enumerate(model_runner_output.req_ids)}
        logprobs_of = model_runner_output.logprobs
        prompt_logprobs_of = model_runner_output.prompt_logprobs
        pooled_of = model_runner_output.pooler_output
        requests = self.requests
        max_model_len = self.max_model_len
        stopped = False
        scheduled = scheduler_output.num_scheduled_tokens
        self._in_flight.difference_update(scheduled)
        for req_id in scheduled:
            req = requests.get(req_id)
            if req is None or req.status in _FINISHED:
                continue  # aborted while the step ran
            for hook in computed_hooks:
                hook(req)
            if pooled_of:
                pooled = pooled_of.get(req_id)
                if pooled is not None:  # a pooling request ends with its prompt: no decode
                    self.finish(req, RequestStatus.FINISHED_STOPPED)
                    stopped = True
                    out = self._output(req, [])
                    out.pooling_output = pooled
                    outputs.append(out)
                    continue
            i = index.get(req_id)
            new_tokens = sampled[i] if i is not None else None
            if not new_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            for hook in verify:
                hook(req, new_tokens, scheduler_output)
            kept = None
            for take in accept:
                kept = take(req, new_tokens, now)
                if kept is not None:
                    break
            if kept is None:
                kept = self._append_tokens(req, new_tokens, now, max_model_len)
            if req.times.first_token is None:
                req.times.first_token = now
            if req.status is _RUNNING:
                out = EngineCoreOutput(req_id, kept, None, req.stop_reason,
                                       max(req.num_cached_tokens, 0))
            else:
                stopped = True
                out = self._output(req, kept)
            if logprobs_of:
                logprobs = logprobs_of.get(req_id)
                if logprobs is not None:
                    # Tokens after a stop are dropped: so are their logprobs.
                    out.new_logprobs = (logprobs if len(logprobs) == len(kept)
                                        else logprobs.slice(0, len(kept)))
            if prompt_logprobs_of:
                out.new_prompt_logprobs = prompt_logprobs_of.get(req_id)
            outputs.append(out)
        if stopped:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _append_tokens(self, req: Request, new_tokens: list[int], now: float,
                       max_model_len: int) -> list[int]:
        """Append the sampled tokens up to a stop; the tokens kept."""
        out_ids, all_ids, times = req.output_token_ids, req.all_token_ids, req.times.token_times
        for j, tok in enumerate(new_tokens):
            out_ids.append(tok)
            all_ids.append(tok)
            times.append(now)
            status = stop_status(req, tok, max_model_len)
            if status is not None:
                self.finish(req, status)
                return new_tokens[:j + 1]
        return list(new_tokens)

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
        self._pending_outputs.append(self._output(req, []))

    def _output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
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
        return (bool(self.requests) or bool(self._pending_outputs)
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
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            step_num_scheduled_tokens=self._step_tokens,
            step_num_preemptions=self._step_preemptions,
            encoder_cache=self.encoder_cache.snapshot(),
        )
        for fill in self.hooks.fill_stats:
            fill(stats)
        return stats
