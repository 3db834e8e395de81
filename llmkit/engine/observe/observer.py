"""The engine core's public observer API: what tools and live views see of each step.

``EngineCore.add_step_observer(obs)`` registers an object whose ``on_step(event)`` runs after
every step with a ``StepEvent``: when the step began, how long ``schedule`` / ``execute`` /
``update`` took, the step's ``SchedulerOutput`` and ``ModelRunnerOutput``, the
``EngineCoreOutput``s it produced, the scheduler's stats after it and its prefill/decode split.
``close()``, if the observer has one, runs once when the engine shuts down. Observers run in the
engine core's thread (in the engine process for a server): they must be quick and must not
call back into the core's step. A step without observers computes none of this.

The step trace (``observability.trace_file``, ``engine/observe/step_trace.py``), ``bench latency`` and
``sim calibrate engine`` are observers; so is anything that wants the step's numbers without
reaching into the scheduler or the executor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.scheduler.base import SchedulerOutput, SchedulerStats

__all__ = ["BatchSplit", "KVState", "RequestState", "StepEvent", "StepObserver",
           "split_prefill_decode"]


@dataclass(slots=True, frozen=True)
class RequestState:
    """A request the engine holds (``EngineCore.request_states()``), for live views."""

    request_id: str
    status: str  # "waiting" | "running" | "preempted" (waiting includes a compiling grammar)
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int  # KV blocks it holds
    arrival_index: int


@dataclass(slots=True, frozen=True)
class KVState:
    """The KV pool now (``EngineCore.kv_state()``): blocks in all, free (empty or cached and
    evictable), and holding a cached prefix (held or idle)."""

    num_blocks: int
    num_free_blocks: int
    num_prefix_cached_blocks: int


class BatchSplit(NamedTuple):
    """A step's batch split into **prefill** requests (computing prompt tokens, or recomputing
    after a preemption) and **decode** requests (past their prompt, computing new tokens).
    ``*_context``: Σ over those requests of their tokens computed after the step."""

    prefill_reqs: int = 0
    prefill_tokens: int = 0
    decode_reqs: int = 0
    decode_tokens: int = 0
    prefill_context: int = 0
    decode_context: int = 0


def split_prefill_decode(scheduler_output: SchedulerOutput,
                         get_request: Callable[[str], Any] | None) -> BatchSplit:
    """The ``BatchSplit`` of one step, read before the scheduler's update (a request that
    finishes in the step is gone from the scheduler after it). A request the runner (re)builds
    this step is prefill; a running one is prefill while the tokens it had computed before
    this step are fewer than its prompt, else decode."""
    counts = scheduler_output.num_scheduled_tokens
    pr = pt = dr = dt = pc = dc = 0
    for new in scheduler_output.scheduled_new_reqs:
        n = counts.get(new.req_id, 0)
        if n:
            pr, pt, pc = pr + 1, pt + n, pc + new.num_computed_tokens + n
    cached = scheduler_output.scheduled_cached_reqs
    for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
        n = counts.get(rid, 0)
        if not n:
            continue
        req = get_request(rid) if get_request is not None else None
        prompt_len = req.num_prompt_tokens if req is not None else 0
        if computed < prompt_len:
            pr, pt, pc = pr + 1, pt + n, pc + computed + n
        else:
            dr, dt, dc = dr + 1, dt + n, dc + computed + n
    return BatchSplit(pr, pt, dr, dt, pc, dc)


@dataclass(slots=True)
class StepEvent:
    """One engine step, as observers receive it (after the step; times in seconds)."""

    step: int  # steps run since the engine started, from 0
    start_s: float  # the core's perf clock (time.perf_counter) when the step began
    schedule_s: float
    execute_s: float
    update_s: float
    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats  # after the step
    split: BatchSplit

    @property
    def step_s(self) -> float:
        return self.schedule_s + self.execute_s + self.update_s

    @property
    def num_reqs(self) -> int:
        """The batch size: requests with tokens scheduled in this step."""
        return sum(1 for n in self.scheduler_output.num_scheduled_tokens.values() if n)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.scheduler_output.total_num_scheduled_tokens

    @property
    def num_preempted(self) -> int:
        """Requests preempted in this step."""
        return len(self.scheduler_output.preempted_req_ids)


@runtime_checkable
class StepObserver(Protocol):
    """What ``EngineCore.add_step_observer`` takes: anything with ``on_step``; a ``close()``
    method, if present, is called once at engine shutdown."""

    def on_step(self, event: StepEvent) -> None: ...
