"""The SLO scheduler's decisions, as one feature of the token-budget scheduler (hooks.py).

At the start of each step, with ``step_time`` (seconds a step of given work takes, from the
cost model: ``(q, c, samples)`` per request, as ``llmkit.cost_model.SeqWork``, and the tokens/s
streamed to clients, estimated from the previous steps' sampled tokens over their times: a
front end sharing the cores slows every step by its share), corrected by what the steps
served so far took (``slo_correction.StepCorrection``: measured over predicted, per decode-only
and mixed step, learned from each step's ``update_from_output(..., step_s=)``):

1. **The budget.** The running requests that decode (their next token is sampled this step)
   compute ``D`` tokens (1 each, plus their draft tokens). The prefill room ``P`` is the
   largest number of tokens in ``[0, max_num_batched_tokens − D]`` whose step, priced as the
   decodes plus one prefill chunk of ``P`` tokens, stays within ``slo.tpot_ms``; so every step
   a decoding request takes is predicted inside its TPOT objective. Without decoding requests
   (or without ``slo.tpot_ms``) ``P`` is the whole room. With ``scheduler.slo_tpot=mean`` the
   objective is each request's mean time per output token (what ``bench serve`` counts): the
   step may take ``slo.tpot_ms`` plus the least time any decoding request is ahead of that
   mean (``tpot·(n − 1) − (now − t_first)`` for ``n`` tokens out, negative when behind), so
   the slack that cheap decode steps bank pays for a longer prefill chunk. The step's budget
   is ``D + P``;
   running prefill chunks and admissions share ``P``, and decodes are never cut for them.
2. **The order.** Waiting requests are sorted by (priority under ``scheduler.policy=priority``,
   then) resumed requests first (they have tokens out; their TTFT is behind them), then by
   TTFT deadline ``arrival + slo.ttft_ms`` (earliest first: least slack), deferred ones last.
3. **Admission** (``scheduler.slo_admission``, with ``slo.ttft_ms`` or ``slo.e2el_ms``): walking
   that order, a request's first token is predicted after ``ceil((A + n) / P)`` steps of the
   step's predicted time (one step of the decodes and ``A + n`` tokens when that is less than
   ``P``), ``A`` the prefill tokens ahead of it (running prefills' and earlier waiting
   requests'), ``n`` its own (``P`` at least one KV block). If that passes its TTFT
   deadline (or, when its ``max_tokens`` is set, the finish — ``max_tokens − 1`` more steps —
   passes its E2EL deadline), ``defer`` moves it behind every request that can still make it
   (counted once; it is served with what capacity is left) and ``reject`` ends it with the
   reason (``FINISHED_REJECTED``, stop_reason ``slo_rejected: ...``); ``off`` only orders.
4. **Prefills never starve.** When prompts wait, ``P`` is at least one KV block, and at least
   what the most urgent prompt needs to meet its TTFT deadline: walking the prefill work in the
   order the step serves it (running prefills, then the waiting order, deferred requests left
   out), a request with ``A`` tokens up to and including its own and ``m + 1`` steps of the
   predicted time left before its deadline needs ``ceil(A / m)`` tokens a step (all ``A`` once
   its deadline is less than two steps away or past), capped by the room. A TPOT objective that
   leaves no room thus costs the decodes some TPOT rather than letting TTFT grow without bound;
   with ``defer`` or ``reject`` the requests admission gave up on do not raise ``P``.
5. **Admission keeps the running requests' TPOT** (``slo_admission`` ``defer`` or ``reject``,
   with ``slo.tpot_ms``): a new prompt's tokens will be computed during the steps of the
   requests decoding now, lengthening them. Each decoding request with ``max_tokens`` has a
   slack ``s = tpot·(N − 1) − (now − t_first) − m·d`` (``N`` its max_tokens, ``m`` the tokens
   it has left, ``d`` the predicted step of the decodes alone) and sees at most ``m·P`` more
   prompt tokens; a waiting request is admitted only while, for every one of them, the
   predicted extra time of the prompt tokens committed (running prefills', those admitted
   before it this step, its own; at most ``m·P``) stays within ``s``. Otherwise it waits
   (admissions end for the step): later, when decodes have finished, it is admitted, or the
   TTFT prediction defers or rejects it.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable, Sequence

from llmkit.config.schema import SloConfig
from llmkit.outputs import SLO_REJECTED
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.hooks import SchedulerFeature
from llmkit.scheduler.slo_correction import StepCorrection

if TYPE_CHECKING:
    from llmkit.scheduler.base import SchedulerOutput, SchedulerStats
    from llmkit.scheduler.slo import SloScheduler

__all__ = ["SloPolicy", "StepTime"]

#: Seconds one step takes, from each scheduled request's (tokens computed, context after the
#: step, whether it samples) and the tokens/s being streamed to clients (a serving front end on
#: the same cores slows steps by its share): ``CostModel.step(work, rate).total_s``.
StepTime = Callable[[Sequence[tuple[int, int, bool]], float], float]

# weight of the latest step in the streamed-rate estimate (an exponential moving average)
_RATE_WEIGHT = 0.2
# the correction is logged after this many steps of a kind, then every _LOG_EVERY
_LOG_FIRST, _LOG_EVERY = 32, 4096

logger = logging.getLogger(__name__)


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1000.0


class SloPolicy(SchedulerFeature):
    name = "slo"

    def __init__(self, sched: SloScheduler, slo: SloConfig, step_time: StepTime,
                 admission: str, min_chunk: int, correction_weight: float = 0.0,
                 tpot_mode: str = "step") -> None:
        self.sched = sched
        self.ttft_s = _ms(slo.ttft_ms)
        self.tpot_s = _ms(slo.tpot_ms)
        self.e2el_s = _ms(slo.e2el_ms)
        self.step_time = step_time
        self.admission = admission
        self.min_chunk = max(1, min_chunk)
        self.correction = StepCorrection(correction_weight)
        self.tpot_mode = tpot_mode
        self.step_limit: float | None = None  # the longest step this one may be (TPOT)
        self.num_rejected = 0
        self.num_deferred = 0
        self._deferred: set[str] = set()
        # this step's decisions (read by the hooks below, and by tests)
        self.budget = 0
        self.prefill_room = 0
        self.tpot_room = 0  # the prefill room TPOT alone allows (before the TTFT floor)
        self.predicted_step_s = 0.0
        self._prefill_left = 0
        # tokens/s sampled for clients (what the front end streams), estimated from the steps
        self.stream_rate = 0.0
        self._last_begin: float | None = None
        self._last_decodes = 0
        # the step last scheduled, as the profile priced it (before the correction) and
        # whether it had prefill tokens, until its measured time comes back
        self._priced: tuple[SchedulerOutput, float, bool] | None = None
        self._decode: list[tuple[int, int, bool]] = []  # this step's decodes, as work
        # admission's TPOT gate (point 5): per decoding request with max_tokens, its slack and
        # the prompt tokens its remaining steps can see; the prompt tokens committed so far
        self._gate: list[tuple[float, int]] | None = None
        self._committed = 0
        self._d = 0.0  # this step's decodes alone, predicted

    # -- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        decode_work, prefills = self._running_work()
        self._decode = decode_work
        self._observe_rate(len(decode_work))
        self._size_step(decode_work, prefills)
        self._arrange(sum(r.num_tokens - r.num_computed_tokens for r in prefills))
        self._ttft_floor(decode_work, prefills)
        self._tpot_gate(prefills)

    def step_budget(self, budget: int) -> int:
        return min(budget, self.budget)

    def limit_running(self, req: Request, n: int) -> int:
        if _decodes(req):
            return n
        return min(n, self._prefill_left)

    def limit_admission(self, req: Request, start: int, n: int) -> int:
        if self._prefill_left <= 0:
            return -1
        if self._gate and not req.num_output_tokens:
            need = req.num_tokens - start
            w = self._committed + need
            d = self._d
            for slack, life in self._gate:
                x = min(w, life)
                if x > 0 and self._price(self._decode, x) - d > slack:
                    return -1  # its prompt would push a decoding request over its mean TPOT
            self._committed = w
        return min(n, self._prefill_left)

    def _tpot_gate(self, prefills: list[Request]) -> None:
        """Each decoding request's TPOT slack and the prompt tokens its remaining steps can
        see (the module's point 5), and the prompt tokens already committed (running
        prefills')."""
        self._gate = None
        if self.tpot_s is None or self.admission == "off" or not self._decode:
            return
        now = self.sched.clock()
        tpot = self.tpot_s
        d = self._d = self._price(self._decode, 0)
        per_step = max(1, self.prefill_room)
        gate = []
        for r in self.sched.running:
            times = r.times.token_times
            if not times or not _decodes(r) or not r.max_tokens:
                continue
            left = r.max_tokens - len(times)
            slack = tpot * (r.max_tokens - 1) - (now - times[0]) - left * d
            gate.append((slack, left * per_step))  # (s, tokens its remaining steps see)
        self._gate = gate
        self._committed = sum(r.num_tokens - r.num_computed_tokens for r in prefills)

    def scheduled(self, req: Request, n: int) -> None:
        if not _decodes(req):
            self._prefill_left -= n

    def end_step(self, out: SchedulerOutput) -> None:
        """Price the step as scheduled, for the correction once its measured time is back."""
        if self.correction.weight <= 0.0 or not out.total_num_scheduled_tokens:
            self._priced = None
            return
        requests = self.sched.requests
        work: list[tuple[int, int, bool]] = []
        mixed = False
        for rid, n in out.num_scheduled_tokens.items():
            r = requests.get(rid)
            if r is None:
                continue
            c = r.num_computed_tokens  # schedule() counted the step's tokens already
            work.append((n, c, c >= r.num_tokens))
            mixed = mixed or r.num_tokens - (c - n) > 1
        self._priced = (out, self.step_time(work, self.stream_rate), mixed) if work else None

    def observe_step(self, out: SchedulerOutput, step_s: float) -> None:
        """The step ``out`` took ``step_s`` seconds (measured by the engine)."""
        priced = self._priced
        if priced is not None and priced[0] is out:
            self._priced = None
            corr = self.correction
            corr.observe(priced[2], priced[1], step_s)
            n = corr.steps[priced[2]]
            if n == _LOG_FIRST or n % _LOG_EVERY == 0:
                kind = "mixed" if priced[2] else "decode-only"
                logger.info("scheduler=slo: %s steps served take %.2fx the cost model's "
                            "prediction (%d measured); predictions follow", kind,
                            corr.factor(priced[2]), n)

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

    def _price(self, decode: list[tuple[int, int, bool]], p: int) -> float:
        """The predicted time of a step of ``decode`` and a prefill chunk of ``p`` tokens: the
        cost model's, corrected by the steps measured so far."""
        work = decode + [(p, p, False)] if p else decode
        if not work:
            return 0.0
        return self.step_time(work, self.stream_rate) * self.correction.factor(p > 0)

    def _running_work(self) -> tuple[list[tuple[int, int, bool]], list[Request]]:
        """The decodes of the running requests as cost-model work, and the running requests
        still computing their prompt."""
        sched = self.sched
        in_flight = sched.in_flight
        decode: list[tuple[int, int, bool]] = []
        prefills: list[Request] = []
        tpot = self.tpot_s
        mean = tpot is not None and self.tpot_mode == "mean"
        now = sched.clock() if mean else 0.0
        bank = math.inf
        for r in sched.running:
            if in_flight and r.request_id in in_flight:
                continue
            if _decodes(r):
                q = 1 + len(r.spec_token_ids)
                decode.append((q, r.num_computed_tokens + q, True))
                if mean:
                    times = r.times.token_times
                    if times:  # time its tokens so far are ahead of (>0) or behind the mean
                        bank = min(bank, tpot * (len(times) - 1) - (now - times[0]))
                    else:
                        bank = min(bank, 0.0)
            else:
                prefills.append(r)
        self.step_limit = None if tpot is None else tpot + (
            0.0 if bank == math.inf else bank)
        return decode, prefills

    def _size_step(self, decode: list[tuple[int, int, bool]], prefills: list[Request]) -> None:
        cap = self.sched.config.max_num_batched_tokens
        d = sum(q for q, _, _ in decode)
        room = self._room = max(0, cap - d)
        price = self._price
        limit = self.step_limit
        if limit is None or not decode:
            p = room
        elif price(decode, room) <= limit:
            p = room
        elif price(decode, 0) > limit:
            p = 0
        else:  # the largest p with the step inside the limit: price grows with p
            lo, hi = 0, room  # price(lo) fits, price(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if price(decode, mid) <= limit:
                    lo = mid
                else:
                    hi = mid
            p = lo
        self.tpot_room = p
        if (prefills or len(self.sched.waiting)) and p < self.min_chunk:
            p = min(room, self.min_chunk)  # prompts progress, if slowly
        self._set_room(decode, d, p)

    def _set_room(self, decode: list[tuple[int, int, bool]], d: int, p: int) -> None:
        self.prefill_room = p
        self._prefill_left = p
        self.budget = max(1, d + p)
        self.predicted_step_s = self._price(decode, p)

    def _ttft_floor(self, decode: list[tuple[int, int, bool]], prefills: list[Request]) -> None:
        """Raise the prefill room to what the most urgent prompt needs to meet its TTFT
        deadline (the module's point 4)."""
        if self.ttft_s is None or not (prefills or len(self.sched.waiting)):
            return
        p, room = self.prefill_room, self._room
        d = sum(q for q, _, _ in decode)
        now = self.sched.clock()
        for _ in range(2):  # the step's time grows with the room: price it again once
            want = min(room, self._needed_per_step(now, self._price(decode, max(p, 1)),
                                                   prefills))
            if want <= p:
                break
            p = want
        if p != self.prefill_room:
            self._set_room(decode, d, p)

    def _needed_per_step(self, now: float, step_s: float, prefills: list[Request]) -> int:
        """The prefill tokens a step must take, from now on, for every prompt (in the order
        the step serves them) to finish by its TTFT deadline at ``step_s`` a step."""
        ttft = self.ttft_s or 0.0
        step_s = max(step_s, 1e-9)
        ahead = want = 0
        for queue in (prefills, self.sched.waiting):
            for r in queue:
                if r.request_id in self._deferred:
                    continue
                ahead += r.num_tokens - r.num_computed_tokens
                if r.status == RequestStatus.PREEMPTED or r.num_output_tokens:
                    continue  # resumed: its first token is out, no TTFT at stake
                # one step short of the deadline: a request waits for the step it is picked
                # up in, and a step may take longer than predicted
                steps = int((r.times.arrival + ttft - now) / step_s) - 1
                want = max(want, -(-ahead // max(1, steps)))
        return want

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
            total = ahead + need
            # steps of the room's size, or one step of just this work when it is smaller
            first = now + math.ceil(total / per_step) * (
                step_s if total >= per_step else self._price(self._decode, total))
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
