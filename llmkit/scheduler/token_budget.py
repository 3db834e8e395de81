"""The token-budget scheduler: every step hands each request some number of tokens.

There are no phases. Running requests go first (each at least one token, prefill chunks
continue), then waiting requests are admitted in queue order, until the step's token budget,
``max_num_seqs`` or the free KV blocks run out. A prompt larger than the remaining budget is
chunked. When blocks run out for a running request, a victim is preempted (its blocks freed,
its KV recomputed later); prefix caching usually keeps most of its blocks reusable.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache.base import KVCacheManagerBase
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import (CachedRequestData, NewRequestData, Scheduler,
                                   SchedulerOutput, SchedulerStats, SpecDecodeStats)
from llmkit.scheduler.connector_admission import KVConnectorAdmission
from llmkit.scheduler.encoder_admission import EncoderAdmission
from llmkit.scheduler.encoder_cache import EncoderCacheManager
from llmkit.scheduler.policies import WAITING_QUEUES, pick_victim

if TYPE_CHECKING:
    from llmkit.kv_transfer.base import KVConnectorBase
    from llmkit.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


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
        # Multi-LoRA: at most this many distinct adapters in one step (None = no limit), and
        # the starvation bound of a waiting request passed over for lack of a slot.
        self.max_loras = max_loras
        self.max_lora_skips = max_lora_skips
        self._lora_skips: dict[str, int] = {}
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.clock = clock
        # EAGLE: a prefix-cache hit leaves its last block to be recomputed (the head's KV at a
        # position depends on the token after it, which only a matching next block fixes).
        self.drop_last_cached_block = drop_last_cached_block
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
        self._spec_stats = SpecDecodeStats()
        self._step_spec_stats = SpecDecodeStats()
        # Structured output: requests wait here (WAITING_FOR_FSM) while their grammar compiles.
        self.structured_output_manager = structured_output_manager
        self._waiting_for_fsm: list[Request] = []
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self._encoder = EncoderAdmission(self.encoder_cache, config.max_num_encoder_input_tokens)
        # KV connector (llmkit/kv_transfer): requests whose KV loads, and finished requests
        # whose blocks stay held for a receiver, are tracked by its admission.
        self.kv_connector = kv_connector
        self._connector = (None if kv_connector is None
                           else KVConnectorAdmission(kv_connector, kv_cache_manager))

    # -- intake --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        request.arrival_index = self._arrivals
        self._arrivals += 1
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        if request.mm_features:
            self._encoder.check_request(request)
        if request.num_prompt_tokens > self.max_model_len:
            # Refuse rather than truncate: the caller learns why through the finish reason.
            request.set_status(RequestStatus.FINISHED_IGNORED)
            request.times.finished = self.clock()
            self._pending_outputs.append(self._output(request, []))
            return
        room = self.max_model_len - request.num_prompt_tokens
        request.max_tokens = room if request.max_tokens is None else min(request.max_tokens,
                                                                           max(room, 1))
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise ValueError(f"request {request.request_id!r} asks for structured output, "
                                 "but this scheduler has no structured-output manager")
            self.structured_output_manager.grammar_init(request)
            request.set_status(RequestStatus.WAITING_FOR_FSM)
            self._waiting_for_fsm.append(request)
            self.requests[request.request_id] = request
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                self._waiting_for_fsm.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # The worker may still write its blocks: they are freed when the load ends.
                self._connector.abort_load(req)
                self._finish(req, RequestStatus.FINISHED_ABORTED, free_blocks=False)
                outs.append(self._output(req, []))
                continue
            else:
                self.waiting.remove(req)
                if self._connector is not None:
                    self._connector.admitted(rid)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outs.append(self._output(req, []))
        return outs

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._waiting_for_fsm:
            self._admit_compiled()
        cfg, kv = self.config, self.kv
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted_ids: set[str] = set()
        lookahead = cfg.num_lookahead_tokens
        spec_tokens: dict[str, list[int]] = {}
        encoder_budget = cfg.max_num_encoder_input_tokens
        encoder_inputs: dict[str, list[int]] = {}

        # The adapters of the requests scheduled so far (multi-LoRA: at most max_loras).
        loras: set[int] = set()

        # 1. Running requests, in admission order: each continues its prefill or decodes.
        pp = self.pipeline_parallel_size
        in_flight = self._in_flight
        max_running = -(-len(self.running) // pp) if pp > 1 else len(self.running)
        num_running = 0
        i = 0
        while i < len(self.running) and budget > 0 and num_running < max_running:
            req = self.running[i]
            if in_flight and req.request_id in in_flight:
                i += 1
                continue
            n = self._num_new_tokens(req, budget)
            if n > 0 and not self._lora_fits(req, loras):
                n = 0
            enc = None
            if n > 0 and req.mm_features:
                enc = self._encoder.plan(req, req.num_computed_tokens, n, encoder_budget)
                n = enc.num_new_tokens
            if n <= 0:
                i += 1
                continue
            drafts = self._schedulable_drafts(req, n, budget)
            n += len(drafts)
            while True:
                new_blocks = kv.allocate_slots(req, n, lookahead)
                if new_blocks is not None:
                    break
                if len(self.running) == 1:
                    # Alone and still out of blocks: the request has outgrown the whole pool.
                    # Preempting it would only re-admit it to grow again (a livelock), so it
                    # ends here, capped by KV capacity as it would be by max_model_len.
                    self.running.pop()
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self._pending_outputs.append(self._output(req, []))
                    break
                # Only requests not yet scheduled this step (nor in flight) may be preempted.
                victim = pick_victim([r for r in self.running[i:]
                                      if r.request_id not in in_flight], cfg.preemption_policy)
                self.running.remove(victim)
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                if enc is not None:
                    self._encoder.release(req, enc)
                continue  # req itself was preempted; `i` already points at the next one
            if enc is not None:
                encoder_budget -= self._encoder.commit(req, enc, encoder_inputs)
            num_scheduled[req.request_id] = n
            budget -= n
            if req.lora_id is not None:
                loras.add(req.lora_id)
            req.spec_token_ids = []  # drafts are verified once (or dropped with the step)
            if drafts:
                spec_tokens[req.request_id] = drafts
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.block_ids_offset.append(len(kv.get_block_ids(req.request_id))
                                           - len(new_blocks))
            if pp > 1:
                c0 = req.num_computed_tokens
                cached.new_token_ids.append(req.all_token_ids[c0:c0 + n])
            num_running += 1
            i += 1

        # 2. Waiting requests, unless this step had to preempt (blocks are scarce). One whose
        # adapter finds no slot this step is passed over (later ones may go ahead, vLLM's
        # rule) and put back in its place; once passed over max_lora_skips times, nothing
        # behind it is admitted until it is, so it waits at most that many steps plus the time
        # the running requests of one resident adapter take to finish.
        skipped: list[Request] = []
        connector = self._connector
        if not preempted_ids:
            while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting.peek()
                if not self._lora_fits(req, loras):
                    self.waiting.pop()
                    skipped.append(req)
                    skips = self._lora_skips[req.request_id] = \
                        self._lora_skips.get(req.request_id, 0) + 1
                    if skips >= self.max_lora_skips:
                        break
                    continue
                # Its KV was loaded by the connector: it holds its blocks already.
                loaded = connector is not None and connector.is_loaded(req.request_id)
                lookup = not loaded and (req.sampling_params.prompt_logprobs is None
                                         or req.num_output_tokens)
                if lookup:
                    computed_blocks, num_hit = kv.get_computed_blocks(req)
                    if self.drop_last_cached_block and computed_blocks:
                        computed_blocks = computed_blocks[:-1]
                        num_hit -= kv.block_size
                else:
                    # Cached positions have no logits: a request that still owes its prompt
                    # logprobs computes its whole prompt (as vLLM does). Its blocks are still
                    # cached for other requests by allocate_slots.
                    computed_blocks, num_hit = [], 0
                num_ext, load_async = 0, False
                if lookup and connector is not None:
                    num_ext, load_async = connector.match(req, num_hit)
                start = req.num_computed_tokens if loaded else num_hit + num_ext
                n = req.num_tokens - start
                if load_async:
                    n = 0  # nothing runs until the KV is here
                elif n > budget and not cfg.enable_chunked_prefill:
                    break
                n = min(n, budget)
                if cfg.long_prefill_token_threshold:
                    n = min(n, cfg.long_prefill_token_threshold)
                enc = None
                if req.mm_features and not load_async:
                    # Cut the chunk before an image the encoder cannot take this step.
                    enc = self._encoder.plan(req, start, n, encoder_budget)
                    n = enc.num_new_tokens
                    if n <= 0:
                        self._encoder.release(req, enc)
                        break
                new_blocks = kv.allocate_slots(req, n + num_ext, lookahead,
                                               new_computed_blocks=computed_blocks,
                                               num_new_computed_tokens=num_hit,
                                               delay_cache_blocks=load_async)
                if new_blocks is None:
                    if enc is not None:
                        self._encoder.release(req, enc)
                    if not self.running and not num_scheduled and (
                            connector is None or not connector.num_loading):
                        # Nothing runs that could free blocks: this request can never fit.
                        self.waiting.pop()
                        self._refuse(req)
                        continue
                    break
                self.waiting.pop()
                if lookup and connector is not None:
                    connector.allocated(req, num_ext)
                if load_async:
                    connector.wait_for_load(req, num_hit, num_ext)
                    continue
                self._lora_skips.pop(req.request_id, None)
                if req.lora_id is not None:
                    loras.add(req.lora_id)
                if enc is not None:
                    encoder_budget -= self._encoder.commit(req, enc, encoder_inputs)
                req.set_status(RequestStatus.RUNNING)
                if loaded:
                    connector.admitted(req.request_id)
                else:
                    req.num_computed_tokens = num_hit + num_ext
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = req.num_computed_tokens
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = self.clock()
                self.running.append(req)
                num_scheduled[req.request_id] = n
                budget -= n
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

        for req in reversed(skipped):  # back in their places, ahead of what came after
            self.waiting.add_preempted(req)

        # The step's tokens count as computed from now: the next schedule() builds on them.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        in_flight.update(num_scheduled)

        total = cfg.max_num_batched_tokens - budget
        self._step_tokens = total
        self._step_preemptions = len(preempted_ids)
        so_ids, bitmask = ([], None) if self.structured_output_manager is None else \
            self.structured_output_manager.grammar_bitmask(self.requests, num_scheduled,
                                                           spec_tokens)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted_ids,
            scheduled_spec_tokens=spec_tokens,
            structured_output_request_ids=so_ids,
            grammar_bitmask=bitmask,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache.get_freed_mm_hashes(),
            kv_connector_metadata=(None if self.kv_connector is None
                                   else self.kv_connector.build_connector_meta()),
        )
        self._finished_req_ids = set()
        return out

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether ``req`` may join a step whose requests so far use the adapters ``loras``."""
        return (self.max_loras is None or req.lora_id is None or req.lora_id in loras
                or len(loras) < self.max_loras)

    # -- structured output ---------------------------------------------------------------------
    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones end."""
        idle = not self.running and not len(self.waiting)
        ready, failed, self._waiting_for_fsm = self.structured_output_manager.take_ready(
            self._waiting_for_fsm, wait=idle)
        for req in ready:
            req.set_status(RequestStatus.WAITING)
            self.waiting.add(req)
        for req in failed:
            req.stop_reason = req.structured_output_request.error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            self._pending_outputs.append(self._output(req, []))

    def _advance_grammar(self, req: Request, tok: int) -> bool:
        """Feed ``tok`` to the request's matcher; True if that ended the request (a token its
        grammar refuses means the bitmask was not applied: fail loudly, never drift)."""
        if self.structured_output_manager.accept_tokens(req, [tok]):
            return False
        req.stop_reason = f"the sampled token {tok} is not allowed by the request's grammar"
        logger.error("request %r: %s", req.request_id, req.stop_reason)
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return True

    def _refuse(self, req: Request) -> None:
        if req.status == RequestStatus.PREEMPTED:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        else:
            self._finish(req, RequestStatus.FINISHED_IGNORED)
        self._pending_outputs.append(self._output(req, []))

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, budget, self.max_model_len - req.num_computed_tokens)
        return n

    def _schedulable_drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The request's draft tokens that fit this step: only while it decodes (one new
        token), within the budget and within max_model_len / max_tokens (tokens past either
        could never be kept)."""
        drafts = req.spec_token_ids
        if not drafts or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return []
        room = min(budget - 1, self.max_model_len - req.num_tokens,
                   req.max_tokens - req.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Draft tokens for the next step, per request (a proposer's output); requests not
        named keep none."""
        for req in self.running:
            req.spec_token_ids = list(draft_token_ids.get(req.request_id, ()))

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self.kv.free(req)
        self.encoder_cache.free(req)
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(req)

    # -- results -------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        self._step_spec_stats = SpecDecodeStats()
        kv_out = model_runner_output.kv_connector_output
        if kv_out is not None and self._connector is not None:
            for req in self._connector.update_from_output(kv_out):
                self.waiting.add_preempted(req)  # ahead of newer work: it holds blocks
        now = self.clock()
        sampled = model_runner_output.sampled_token_ids
        index = {rid: i for i, rid in enumerate(model_runner_output.req_ids)}
        stopped: list[Request] = []
        in_flight = self._in_flight
        for req_id in scheduler_output.num_scheduled_tokens:
            in_flight.discard(req_id)
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            if req.mm_features:
                self._encoder.free_computed(req)
            pooled = model_runner_output.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request ends with its prompt: no decode
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                stopped.append(req)
                outputs.append(self._output(req, []))
                outputs[-1].pooling_output = pooled
                continue
            i = index.get(req_id)
            new_tokens = sampled[i] if i is not None else []
            if not new_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id)
            if drafts:
                # 1 + K tokens were computed; the KV of the rejected drafts' positions is
                # garbage: those tokens are no longer computed, and their slots go back.
                num_rejected = len(drafts) + 1 - len(new_tokens)
                req.num_computed_tokens -= num_rejected
                req.spec_token_ids = []
                if num_rejected:
                    self.kv.shrink_slots(req, req.num_computed_tokens)
                self._spec_stats.observe(len(drafts), len(new_tokens) - 1)
                self._step_spec_stats.observe(len(drafts), len(new_tokens) - 1)
            kept: list[int] = []
            constrained = req.structured_output_request is not None
            for tok in new_tokens:
                req.append_output_token(tok)
                kept.append(tok)
                req.times.token_times.append(now)
                if constrained and self._advance_grammar(req, tok):
                    break
                if self._check_stop(req, tok):
                    break
            else:
                if constrained and self.structured_output_manager.should_terminate(req):
                    # Only EOS may follow: take it now (what sampling under the bitmask would
                    # pick) rather than after another step.
                    req.append_output_token(req.eos_token_id)
                    kept.append(req.eos_token_id)
                    req.times.token_times.append(now)
                    if not self._advance_grammar(req, req.eos_token_id):
                        self._check_stop(req, req.eos_token_id)
            if req.times.first_token is None:
                req.times.first_token = now
            if req.is_finished:
                stopped.append(req)
            out = self._output(req, kept)
            logprobs = model_runner_output.logprobs.get(req_id)
            if logprobs is not None:
                # Tokens after a stop are dropped: so are their logprobs.
                out.new_logprobs = (logprobs if len(logprobs) == len(kept)
                                    else logprobs.slice(0, len(kept)))
            out.new_prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
            outputs.append(out)
        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
        return outputs

    def _check_stop(self, req: Request, tok: int) -> bool:
        """Apply stop conditions after ``tok`` was appended; finish the request if one holds."""
        sp = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= sp.min_tokens:
            if tok == req.eos_token_id and not sp.ignore_eos:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return True
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return True
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
            return True
        return False

    def _finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        req.set_status(status)
        req.times.finished = self.clock()
        if self._connector is not None:
            # While a receiver loads them, they are freed when the worker says it is done.
            free_blocks = self._connector.request_finished(req, free_blocks)
        if free_blocks:
            self.kv.free(req)
        if req.mm_features:
            self.encoder_cache.free(req)
        self._finished_req_ids.add(req.request_id)
        self._lora_skips.pop(req.request_id, None)
        del self.requests[req.request_id]

    def _output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            kv_transfer_params=(req.kv_transfer_params if self.kv_connector is not None
                                and req.is_finished else None),
        )

    # -- introspection -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        # Held blocks of finished requests keep the engine stepping: their transfers end in a
        # step's connector output.
        return (bool(self.requests) or bool(self._pending_outputs)
                or (self._connector is not None and self._connector.holds_blocks()))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def unfinished_requests(self) -> Iterable[Request]:
        return list(self.requests.values())

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=(len(self.waiting) + len(self._waiting_for_fsm)
                         + (self._connector.num_loading if self._connector is not None else 0)),
            kv_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            step_num_scheduled_tokens=self._step_tokens,
            step_num_preemptions=self._step_preemptions,
            spec_decode=self._spec_stats.snapshot(),
            running_lora_adapters=_count_loras(self.running) if self.max_loras else {},
            waiting_lora_adapters=_count_loras(self.waiting) if self.max_loras else {},
            step_spec_decode=self._step_spec_stats.snapshot(),
            encoder_cache=self.encoder_cache.snapshot(),
            kv_connector=(self.kv_connector.stats.snapshot() if self.kv_connector is not None
                          else None),
        )


def _count_loras(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name (base-model requests are not counted)."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_id is not None:
            name = req.lora_name or str(req.lora_id)
            counts[name] = counts.get(name, 0) + 1
    return counts
