"""A step's second phase: waiting requests are admitted in queue order, each with its
prefix-cache hit (and the tokens a KV connector brings), while the budget, ``max_num_seqs``
and the free blocks last. A request that could never fit (nothing runs that would free blocks)
is refused; a prompt that does not fit the budget is chunked (or waits, without chunked
prefill)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import NewRequestData
from llmkit.scheduler.hooks import ADMIT, PASS_OVER_AND_STOP
from llmkit.scheduler.running_phase import shorter_chunk

if TYPE_CHECKING:
    from llmkit.scheduler.token_budget import TokenBudgetScheduler


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
