"""A step's first phase: the running requests, in admission order, each continue their prefill
or decode by as many tokens as the budget, ``long_prefill_token_threshold`` and
``max_model_len`` allow (features may cut that, or add draft tokens). When the KV blocks run
out, requests not yet scheduled this step are preempted (``scheduler.preemption_policy``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import CachedRequestData
from llmkit.scheduler.policies import pick_victim

if TYPE_CHECKING:
    from llmkit.kv_cache.base import KVCacheManagerBase
    from llmkit.kv_cache.blocks import KVCacheBlock
    from llmkit.scheduler.token_budget import TokenBudgetScheduler


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
