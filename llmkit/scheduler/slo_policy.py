"""The SLO scheduler's decisions, as one feature of the token-budget scheduler (hooks.py).

At the start of each step, with ``step_time`` (seconds a step of given work takes, from the
cost model: ``(q, c, samples)`` per request, as ``llmkit.cost_model.SeqWork``, and the tokens/s
streamed to clients, estimated from the previous steps' sampled tokens over their times: a
front end sharing the cores slows every step by its share):

1. **The budget.** The running requests that decode (their next token is sampled this step)
   compute ``D`` tokens (1 each, plus their draft tokens). The prefill room ``P`` is the
   largest number of tokens in ``[0, max_num_batched_tokens − D]`` whose step, priced as the
   decodes plus one prefill chunk of ``P`` tokens, stays within ``slo.tpot_ms``; so every step
   a decoding request takes is predicted inside its TPOT objective. Without decoding requests
   (or without ``slo.tpot_ms``) ``P`` is the whole room. ``P`` never falls below one KV block
   while prefill work waits, so prompts progress when the decodes alone are predicted over the
   objective. The step's budget is ``D + P``; running prefill chunks and admissions share
   ``P``, and decodes are never cut for them.
2. **The order.** Waiting requests are sorted by (priority under ``scheduler.policy=priority``,
   then) resumed requests first (they have tokens out; their TTFT is behind them), then by
   TTFT deadline ``arrival + slo.ttft_ms`` (earliest first: least slack), deferred ones last.
3. **Admission** (``scheduler.slo_admission``, with ``slo.ttft_ms`` or ``slo.e2el_ms``): walking
   that order, a request's first token is predicted after ``ceil((A + n) / P)`` steps of the
   step's predicted time, ``A`` the prefill tokens ahead of it (running prefills' and earlier
   waiting requests'), ``n`` its own. If that passes its TTFT deadline (or, when its
   ``max_tokens`` is set, the finish — ``max_tokens − 1`` more steps — passes its E2EL
   deadline), ``defer`` moves it behind every request that can still make it (counted once;
   it is served with what capacity is left) and ``reject`` ends it with the reason
   (``FINISHED_REJECTED``, stop_reason ``slo_rejected: ...``); ``off`` only orders.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from llmkit.config.schema import SloConfig
from llmkit.outputs import SLO_REJECTED
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.hooks import SchedulerFeature

if TYPE_CHECKING:
    from llmkit.scheduler.base import SchedulerStats
    from llmkit.scheduler.slo import SloScheduler

__all__ = ["SloPolicy", "StepTime"]

#: Seconds one step takes, from each scheduled request's (tokens computed, context after the
#: step, whether it samples) and the tokens/s being streamed to clients (a serving front end on
#: the same cores slows steps by its share): ``CostModel.step(work, rate).total_s``.
StepTime = Callable[[Sequence[tuple[int, int, bool]], float], float]

# weight of the latest step in the streamed-rate estimate (an exponential moving average)
_RATE_WEIGHT = 0.2


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1000.0


class SloPolicy(SchedulerFeature):
    name = "slo"

    def __init__(self, sched: SloScheduler, slo: SloConfig, step_time: StepTime,
                 admission: str, min_chunk: int) -> None:
        self.sched = sched
        self.ttft_s = _ms(slo.ttft_ms)
        self.tpot_s = _ms(slo.tpot_ms)
        self.e2el_s = _ms(slo.e2el_ms)
        self.step_time = step_time
        self.admission = admission
        self.min_chunk = max(1, min_chunk)
        self.num_rejected = 0
        self.num_deferred = 0
        self._deferred: set[str] = set()
        # this step's decisions (read by the hooks below, and by tests)
        self.budget = 0
        self.prefill_room = 0
        self.predicted_step_s = 0.0
        self._prefill_left = 0
        # tokens/s sampled for clients (what the front end streams), estimated from the steps
        self.stream_rate = 0.0
        self._last_begin: float | None = None
        self._last_decodes = 0

    # -- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        decode_work, prefill_running = self._running_work()
        self._observe_rate(len(decode_work))
        self._size_step(decode_work, prefill_running)
        self._arrange(prefill_running)

    def step_budget(self, budget: int) -> int:
        return min(budget, self.budget)

    def limit_running(self, req: Request, n: int) -> int:
        if _decodes(req):
            return n
        return min(n, self._prefill_left)

    def limit_admission(self, req: Request, start: int, n: int) -> int:
        return min(n, self._prefill_left) if self._prefill_left > 0 else -1

    def scheduled(self, req: Request, n: int) -> None:
        if not _decodes(req):
            self._prefill_left -= n

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.slo_rejected_total = self.num_rejected
        stats.slo_deferred_total = self.num_deferred

    def finished(self, req: Request, free_blocks: bool) -> bool:
        self._deferred.discard(req.request_id)
        return free_blocks

    # -- the budget --------------------------------------------------------------------------
    def _observe_rate(self, decodes: int) -> None:
        """Update the streamed-rate estimate: the previous step's sampled tokens over the time
        since it began."""
        now = self.sched.clock()
        last = self._last_begin
        if last is not None and now > last:
            rate = self._last_decodes / (now - last)
            self.stream_rate += _RATE_WEIGHT * (rate - self.stream_rate)
        self._last_begin, self._last_decodes = now, decodes

    def _price(self, work: list[tuple[int, int, bool]]) -> float:
        return self.step_time(work, self.stream_rate)

    def _running_work(self) -> tuple[list[tuple[int, int, bool]], int]:
        """The decodes of the running requests as cost-model work, and the prompt tokens the
        running prefills still have to compute."""
        sched = self.sched
        in_flight = sched.in_flight
        decode: list[tuple[int, int, bool]] = []
        prefill = 0
        for r in sched.running:
            if in_flight and r.request_id in in_flight:
                continue
            if _decodes(r):
                q = 1 + len(r.spec_token_ids)
                decode.append((q, r.num_computed_tokens + q, True))
            else:
                prefill += r.num_tokens - r.num_computed_tokens
        return decode, prefill

    def _size_step(self, decode: list[tuple[int, int, bool]], prefill_running: int) -> None:
        cap = self.sched.config.max_num_batched_tokens
        d = sum(q for q, _, _ in decode)
        room = max(0, cap - d)
        price = self._price
        if self.tpot_s is None or not decode:
            p = room
        elif price(decode + [(room, room, False)]) <= self.tpot_s:
            p = room
        elif price(decode) > self.tpot_s:
            p = 0
        else:  # the largest p with the step inside TPOT: price grows with p
            lo, hi = 0, room  # price(lo) fits, price(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if price(decode + [(mid, mid, False)]) <= self.tpot_s:
                    lo = mid
                else:
                    hi = mid
            p = lo
        if (prefill_running or len(self.sched.waiting)) and p < self.min_chunk:
            p = min(room, self.min_chunk)  # prompts progress, if slowly
        self.prefill_room = p
        self._prefill_left = p
        self.budget = max(1, d + p)
        work = decode + ([(p, p, False)] if p else [])
        self.predicted_step_s = price(work) if work else 0.0

    # -- the order and admission -------------------------------------------------------------
    def _key(self, r: Request) -> tuple:
        prio = r.priority if self.sched.config.policy == "priority" else 0
        if r.status == RequestStatus.PREEMPTED or r.num_output_tokens:
            return (prio, 0, 0.0, r.arrival_index)
        deadline = r.times.arrival + (self.ttft_s or 0.0)
        return (prio, 2 if r.request_id in self._deferred else 1, deadline, r.arrival_index)

    def _arrange(self, prefill_running: int) -> None:
        waiting = self.sched.waiting
        if not len(waiting):
            return
        waiting.arrange(self._key)
        if self.admission == "off" or (self.ttft_s is None and self.e2el_s is None):
            return
        now = self.sched.clock()
        step_s = self.predicted_step_s
        per_step = max(1, self.prefill_room)
        ahead = prefill_running
        late: list[tuple[Request, str]] = []
        for r in waiting:
            need = r.num_tokens - r.num_computed_tokens
            if self._key(r)[1] != 1:  # resumed (no TTFT at stake) or deferred already
                if self._key(r)[1] == 0:
                    ahead += need
                continue
            first = now + math.ceil((ahead + need) / per_step) * step_s
            why = self._misses(r, first, step_s)
            if why is None:
                ahead += need
            else:
                late.append((r, why))
        if not late:
            return
        for r, why in late:
            if self.admission == "reject":
                self._reject(r, why)
            else:
                self._deferred.add(r.request_id)
                self.num_deferred += 1
        if self.admission == "defer":
            waiting.arrange(self._key)

    def _misses(self, r: Request, first: float, step_s: float) -> str | None:
        """Why ``r``, its first token predicted at ``first``, cannot meet its SLO (None: it
        can)."""
        arrival = r.times.arrival
        if self.ttft_s is not None and first > arrival + self.ttft_s:
            return (f"predicted TTFT {first - arrival:.3f} s > slo.ttft_ms="
                    f"{self.ttft_s * 1000:g}")
        max_tokens = r.sampling_params.max_tokens
        if self.e2el_s is not None and max_tokens:
            end = first + (max_tokens - 1) * step_s
            if end > arrival + self.e2el_s:
                return (f"predicted E2EL {end - arrival:.3f} s > slo.e2el_ms="
                        f"{self.e2el_s * 1000:g}")
        return None

    def _reject(self, r: Request, why: str) -> None:
        self.sched.waiting.remove(r)
        r.stop_reason = f"{SLO_REJECTED}: {why}"
        self.num_rejected += 1
        self.sched.report_finished(r, RequestStatus.FINISHED_REJECTED)


def _decodes(r: Request) -> bool:
    """Whether the request's next scheduled token is sampled (it is past its prompt)."""
    return r.num_tokens - r.num_computed_tokens <= 1
