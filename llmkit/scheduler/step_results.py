"""After a step ran: its sampled tokens join their requests, stop conditions end them
(``stop_status``: the sampling parameters' stop conditions and the length caps,
``max_tokens`` and ``max_model_len``), and each request that got tokens gets its output."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import SchedulerOutput

if TYPE_CHECKING:
    from llmkit.scheduler.token_budget import TokenBudgetScheduler

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
        if kept is not None:
            pass
        elif len(new_tokens) == 1:  # the common case, without a call per token
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
        else:
            kept = append_tokens(sched, req, new_tokens, now, max_model_len)
        if times.first_token is None:
            times.first_token = now
        if req.status is _RUNNING:
            out = EngineCoreOutput(req_id, kept, None, req.stop_reason,
                                   max(req.num_cached_tokens, 0))
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
