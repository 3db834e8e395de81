"""What one token-budget step runs, in order: scheduling's two phases with the two policies they
follow (the waiting queue's order, the preemption victim), then the step's results.

1. Running: the running requests, in admission order, each continue their prefill or decode by
   as many tokens as the budget, ``long_prefill_token_threshold`` and ``max_model_len`` allow
   (features may cut that, or add draft tokens). When the KV blocks run out, requests not yet
   scheduled this step are preempted (``scheduler.preemption_policy``, ``pick_victim``).
2. Admission: waiting requests are admitted in queue order (``scheduler.policy``: a
   ``WaitingQueue``), each with its prefix-cache hit (and the tokens a KV connector brings),
   while the budget, ``max_num_seqs`` and the free blocks last. A request that could never fit
   (nothing runs that would free blocks) is refused; a prompt that does not fit the budget is
   chunked (or waits, without chunked prefill).
3. Results (``update_from_output``, after the step ran): its sampled tokens join their
   requests, stop conditions end them (``stop_status``: the sampling parameters' stop
   conditions and the length caps, ``max_tokens`` and ``max_model_len``), and each request
   that got tokens gets its output.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Iterator

from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import CachedRequestData, NewRequestData, SchedulerOutput
from llmkit.scheduler.hooks import ADMIT, PASS_OVER_AND_STOP

if TYPE_CHECKING:
    from llmkit.kv_cache.base import KVCacheManagerBase
    from llmkit.kv_cache.block_pool import KVCacheBlock
    from llmkit.scheduler.token_budget import TokenBudgetScheduler


# -- the running phase -----------------------------------------------------------------------
def schedule_running(sched: TokenBudgetScheduler, budget: int,
                     num_scheduled: dict[str, int], cached: CachedRequestData,
                     preempted_ids: set[str]) -> int:
    """Schedule the running requests into ``num_scheduled`` and ``cached``; the budget left.
    The step's tokens count as computed from here on: the next schedule() builds on them."""
    hooks = sched.hooks
    limit, extra = hooks.limit_running, hooks.extra_tokens
    scheduled_hooks, not_scheduled = hooks.scheduled, hooks.not_scheduled
    kv = sched.kv
    allocate, num_blocks_held = kv.allocate_slots, kv.num_blocks_held
    lookahead = sched.config.num_lookahead_tokens
    long_prefill = sched.config.long_prefill_token_threshold
    max_model_len = sched.max_model_len
    pp = sched.pipeline_parallel_size
    in_flight = sched.in_flight
    running = sched.running
    max_running = -(-len(running) // pp) if pp > 1 else len(running)
    c_ids, c_blocks = cached.req_ids, cached.new_block_ids
    c_computed, c_offsets = cached.num_computed_tokens, cached.block_ids_offset
    # the hybrid manager's ids: one list (and one offset) per KV-cache group
    grouped = kv.grouped_block_ids
    shrink = kv.smaller_chunks_may_fit and sched.config.enable_chunked_prefill
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
        if new_blocks is None and shrink and 1 < n <= len(req.all_token_ids) - computed:
            n, new_blocks = shorter_chunk(kv, req, n, lookahead)
        if new_blocks is None:
            new_blocks = _make_room(sched, req, n, lookahead, i, preempted_ids)
            if new_blocks is None:
                for hook in not_scheduled:
                    hook(req)
                continue  # req itself was preempted; `i` already points at the next one
        num_scheduled[rid] = n
        budget -= n
        for hook in scheduled_hooks:
            hook(req, n)
        c_ids.append(rid)
        if grouped:
            ids, offsets = kv.block_ids_update(rid, new_blocks)
            c_blocks.append(ids)
            c_offsets.append(offsets)
        else:
            c_blocks.append([b.block_id for b in new_blocks] if new_blocks else [])
            c_offsets.append(num_blocks_held(rid) - len(new_blocks))
        c_computed.append(computed)
        if pp > 1:
            cached.new_token_ids.append(req.all_token_ids[computed:computed + n])
        req.num_computed_tokens = computed + n
        num_running += 1
        i += 1
    return budget


def shorter_chunk(kv: KVCacheManagerBase, req: Request, n: int, lookahead: int, **computed_hit
                  ) -> tuple[int, list[KVCacheBlock] | None]:
    """The longest chunk of ``req``'s next ``n`` tokens (halving) that gets blocks, and its
    blocks; ``(n, None)`` if not even one token does. For managers whose blocks for a chunk
    shrink with it (``smaller_chunks_may_fit``): a prompt longer than a window's share of the
    pool still runs, a chunk at a time, instead of being refused."""
    m = n // 2
    while m >= 1:
        blocks = kv.allocate_slots(req, m, lookahead, **computed_hit)
        if blocks is not None:
            return m, blocks
        m //= 2
    return n, None


def _make_room(sched: TokenBudgetScheduler, req: Request, n: int, lookahead: int, i: int,
               preempted_ids: set[str]) -> list[KVCacheBlock] | None:
    """Preempt running requests not yet scheduled this step (nor in flight) until ``req``'s
    slots fit; its new blocks, or None if ``req`` itself went (preempted, or alone and still
    out of blocks)."""
    running = sched.running
    in_flight = sched.in_flight
    while True:
        if len(running) == 1:
            # Alone and still out of blocks: the request has outgrown the whole pool.
            # Preempting it would only re-admit it to grow again (a livelock), so it
            # ends here, capped by KV capacity as it would be by max_model_len.
            running.pop()
            sched.report_finished(req, RequestStatus.FINISHED_LENGTH_CAPPED)
            return None
        victim = pick_victim([r for r in running[i:] if r.request_id not in in_flight],
                             sched.config.preemption_policy)
        running.remove(victim)
        sched.preempt(victim)
        preempted_ids.add(victim.request_id)
        if victim is req:
            return None
        new_blocks = sched.kv.allocate_slots(req, n, lookahead)
        if new_blocks is not None:
            return new_blocks


# -- the admission phase ---------------------------------------------------------------------
def admit_waiting(sched: TokenBudgetScheduler, budget: int, num_scheduled: dict[str, int],
                  new_reqs: list[NewRequestData]) -> int:
    """Admit waiting requests into ``num_scheduled`` and ``new_reqs``; the budget left."""
    hooks = sched.hooks
    cfg, kv, waiting, running = sched.config, sched.kv, sched.waiting, sched.running
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
        alone = not running and not num_scheduled and not any(b() for b in hooks.busy)
        if (new_blocks is None and alone and kv.smaller_chunks_may_fit
                and cfg.enable_chunked_prefill and not load_async and not num_ext and n > 1):
            n, new_blocks = shorter_chunk(kv, req, n, cfg.num_lookahead_tokens,
                                          new_computed_blocks=computed_blocks,
                                          num_new_computed_tokens=num_hit)
        if new_blocks is None:
            for hook in hooks.not_scheduled:
                hook(req)
            if alone:
                # Nothing runs that could free blocks: this request can never fit.
                waiting.pop()
                _refuse(sched, req)
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
            req.times.first_scheduled = sched.clock()
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


def _refuse(sched: TokenBudgetScheduler, req: Request) -> None:
    sched.report_finished(req, RequestStatus.FINISHED_ABORTED
                         if req.status == RequestStatus.PREEMPTED
                         else RequestStatus.FINISHED_IGNORED)


# -- the step's results ----------------------------------------------------------------------
_RUNNING = RequestStatus.RUNNING
_FINISHED = frozenset(s for s in RequestStatus if s.finished)


def apply_step_results(sched: TokenBudgetScheduler, scheduler_output: SchedulerOutput,
                       model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """Apply the step's sampled tokens; the outputs of the requests that got tokens or ended
    (those that ended outside a step first)."""
    hooks = sched.hooks
    outputs, sched.pending_outputs = sched.pending_outputs, []
    for begin in hooks.begin_update:
        begin(model_runner_output)
    computed_hooks, verify, accept = hooks.computed, hooks.verify, hooks.accept_tokens
    now = sched.clock()
    sampled = model_runner_output.sampled_token_ids
    index = {rid: i for i, rid in enumerate(model_runner_output.req_ids)}
    logprobs_of = model_runner_output.logprobs
    prompt_logprobs_of = model_runner_output.prompt_logprobs
    pooled_of = model_runner_output.pooler_output
    requests = sched.requests
    max_model_len = sched.max_model_len
    stopped = False
    scheduled = scheduler_output.num_scheduled_tokens
    sched.in_flight.difference_update(scheduled)
    for req_id in scheduled:
        req = requests.get(req_id)
        if req is None or req.status in _FINISHED:
            continue  # aborted while the step ran
        for hook in computed_hooks:
            hook(req)
        if pooled_of:
            pooled = pooled_of.get(req_id)
            if pooled is not None:  # a pooling request ends with its prompt: no decode
                sched.finish(req, RequestStatus.FINISHED_STOPPED)
                stopped = True
                out = sched.make_output(req, [])
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
        times = req.times
        if kept is None and len(new_tokens) == 1:  # the common case, without a call per token
            tok = new_tokens[0]
            out_ids, all_ids = req.output_token_ids, req.all_token_ids
            out_ids.append(tok)
            all_ids.append(tok)
            times.token_times.append(now)
            sp = req.sampling_params
            # Surely not a stop (then no need to ask stop_status, whatever min_tokens says).
            if (len(out_ids) >= req.max_tokens or len(all_ids) >= max_model_len
                    or (tok == req.eos_token_id and not sp.ignore_eos)
                    or tok in sp.stop_token_ids):
                status = stop_status(req, tok, max_model_len)
                if status is not None:
                    sched.finish(req, status)
            kept = [tok]
        elif kept is None:
            kept = append_tokens(sched, req, new_tokens, now, max_model_len)
        if times.first_token is None:
            times.first_token = now
        if req.status is _RUNNING:
            cached_toks = req.num_cached_tokens  # max(.., 0) without the call, per request
            out = EngineCoreOutput(req_id, kept, None, req.stop_reason,
                                   cached_toks if cached_toks > 0 else 0)
        else:
            stopped = True
            out = sched.make_output(req, kept)
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
        sched.running = [r for r in sched.running if r.status is _RUNNING]
    return outputs


def append_tokens(sched: TokenBudgetScheduler, req: Request, new_tokens: list[int],
                  now: float, max_model_len: int) -> list[int]:
    """Append the sampled tokens up to a stop; the tokens kept."""
    out_ids, all_ids, times = req.output_token_ids, req.all_token_ids, req.times.token_times
    for j, tok in enumerate(new_tokens):
        out_ids.append(tok)
        all_ids.append(tok)
        times.append(now)
        status = stop_status(req, tok, max_model_len)
        if status is not None:
            sched.finish(req, status)
            return new_tokens[:j + 1]
    return list(new_tokens)


def stop_status(req: Request, tok: int, max_model_len: int) -> RequestStatus | None:
    """The status ``req`` ends with now that ``tok`` was appended (None: it goes on); a stop
    token is recorded as its ``stop_reason``."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    if n_out >= sp.min_tokens:
        if tok == req.eos_token_id and not sp.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if tok in sp.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens or len(req.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


# -- the policies: the waiting queue's order, the preemption victim ----------------------------
class WaitingQueue(ABC):
    """Requests waiting for admission, in the order the policy admits them."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """A preempted request goes back; it should run again before newer work."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(WaitingQueue):
    """Lower ``priority`` first, then earlier arrival; a preempted request keeps its place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._removed: set[int] = set()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_index, request))

    add_preempted = add

    def _clean(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def peek(self) -> Request:
        self._clean()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._clean()
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))
        self._clean()

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, _, r in sorted(self._heap, key=lambda e: e[:2])
                if id(r) not in self._removed)


WAITING_QUEUES: dict[str, type[WaitingQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt when KV blocks run out.

    ``lifo``: the most recently admitted (it has waited least and usually holds least).
    ``fewest_computed_tokens``: the one whose recomputation costs least.
    """
    if policy == "lifo":
        return running[-1]
    if policy == "fewest_computed_tokens":
        # Ties go to the most recently admitted, as under lifo.
        return min(reversed(running), key=lambda r: r.num_computed_tokens)
    raise ValueError(f"scheduler.preemption_policy: got {policy!r}; allowed: lifo, "
                     "fewest_computed_tokens")
