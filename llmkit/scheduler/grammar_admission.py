"""Structured output's part in scheduling: a request with a grammar waits (WAITING_FOR_FSM)
while it compiles, each step's constrained requests get their bitmask, and every token a
constrained request samples advances its matcher.

The scheduler turns this feature on with the first request that asks for structured output.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import SchedulerOutput
from llmkit.scheduler.hooks import FeatureHost, SchedulerFeature

if TYPE_CHECKING:
    from llmkit.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class GrammarAdmission(SchedulerFeature):
    name = "grammar"

    def __init__(self, manager: StructuredOutputManager, sched: FeatureHost) -> None:
        self.manager = manager
        self._sched = sched
        self.waiting_for_fsm: list[Request] = []

    def hold_request(self, req: Request) -> bool:
        if not req.use_structured_output:
            return False
        self.manager.grammar_init(req)
        req.set_status(RequestStatus.WAITING_FOR_FSM)
        self.waiting_for_fsm.append(req)
        return True

    def drop_held(self, req: Request) -> bool | None:
        if req.status != RequestStatus.WAITING_FOR_FSM:
            return None
        self.waiting_for_fsm.remove(req)
        return True

    def begin_step(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones end."""
        if not self.waiting_for_fsm:
            return
        sched = self._sched
        idle = not sched.running and not len(sched.waiting)
        ready, failed, self.waiting_for_fsm = self.manager.take_ready(
            self.waiting_for_fsm, wait=idle)
        for req in ready:
            req.set_status(RequestStatus.WAITING)
            sched.waiting.add(req)
        for req in failed:
            req.stop_reason = req.structured_output_request.error
            sched.report_finished(req, RequestStatus.FINISHED_ERROR)

    def end_step(self, out: SchedulerOutput) -> None:
        out.structured_output_request_ids, out.grammar_bitmask = self.manager.grammar_bitmask(
            self._sched.requests, out.num_scheduled_tokens, out.scheduled_spec_tokens)

    def accept_tokens(self, req: Request, new_tokens: list[int], now: float
                      ) -> list[int] | None:
        if req.structured_output_request is None:
            return None
        sched = self._sched
        kept: list[int] = []
        for tok in new_tokens:
            req.append_output_token(tok)
            kept.append(tok)
            req.times.token_times.append(now)
            if self._advance(req, tok) or sched.check_stop(req, tok):
                break
        else:
            if self.manager.should_terminate(req):
                # Only EOS may follow: take it now (what sampling under the bitmask would
                # pick) rather than after another step.
                eos = req.eos_token_id
                req.append_output_token(eos)
                kept.append(eos)
                req.times.token_times.append(now)
                if not self._advance(req, eos):
                    sched.check_stop(req, eos)
        return kept

    def _advance(self, req: Request, tok: int) -> bool:
        """Feed ``tok`` to the request's matcher; True if that ended the request (a token its
        grammar refuses means the bitmask was not applied: fail loudly, never drift)."""
        if self.manager.accept_tokens(req, [tok]):
            return False
        req.stop_reason = f"the sampled token {tok} is not allowed by the request's grammar"
        logger.error("request %r: %s", req.request_id, req.stop_reason)
        self._sched.finish(req, RequestStatus.FINISHED_ERROR)
        return True

    def num_held(self) -> int:
        return len(self.waiting_for_fsm)
