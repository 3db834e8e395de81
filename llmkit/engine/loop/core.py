"""EngineCore: the control-plane loop. schedule → execute → update, on token ids only. It runs
the loop only: ``core_builder`` builds what it drives, ``llmkit/lora/adapters.py`` keeps the
adapters and their users.

One step function. With an executor that keeps several steps in flight
(``max_concurrent_batches`` > 1: pipeline parallel's stages) it runs a batch queue (vLLM's
``step_with_batch_queue``): while the queue has room it schedules another batch and sends it
without waiting; when it is full (or nothing more can be scheduled) it waits for the oldest
batch and updates from its output. The scheduler never puts a request in a batch while its
previous one is in flight, so every request's tokens are what one step at a time would give.
One step at a time is the same loop with a queue of one batch, run as it is sent.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.engine.loop.core_builder import build_core_parts
from llmkit.engine.observe.observer import (KVState, RequestState, StepEvent, StepObserver,
                                            split_prefill_decode)
from llmkit.engine.observe.step_trace import StepTrace
from llmkit.executor import BackendInfo, Executor, ModelFacts
from llmkit.executor.base import StepFuture
from llmkit.lora.adapters import AdapterTable, configured_adapters
from llmkit.lora.request import LoRARequest
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler import CachedRequestData, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlightBatch:
    """A batch sent to the executor whose output has not been taken yet (with one step at a
    time: the step just run)."""

    # its output when it ran as it was sent (one step at a time), else its future
    result: ModelRunnerOutput | StepFuture
    scheduler_output: SchedulerOutput
    step: int
    start_s: float
    schedule_s: float
    split: Any  # its BatchSplit when observers watch, else None
    send_s: float  # the time sending took (the whole step when it runs as it is sent)
    clock_s: float  # when it began on the engine's clock (virtual under the simulator)


def _nothing_computed() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class EngineCore:
    def __init__(self, config: EngineConfig, *, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, **executor_kwargs) -> None:
        parts = build_core_parts(config, executor=executor, clock=clock, **executor_kwargs)
        self.config = config
        self.clock = clock
        self.platform = parts.platform
        self.executor = executor = parts.executor
        facts = executor.model_facts
        self.max_model_len = facts.max_model_len
        self.eos_token_id = facts.eos_token_id
        self.num_blocks = parts.num_blocks
        self.kv_connector = parts.kv_connector
        self.kv_cache_manager = parts.kv_cache_manager
        self.structured_output_manager = parts.structured_output_manager
        self.scheduler = parts.scheduler
        self._speculative = config.speculative.enabled
        # LoRA off: no request holds an adapter, so no step has adapters to release.
        self._lora = config.lora.enabled
        # Multi-LoRA: the adapters registered and their users (llmkit/lora/adapters.py).
        self.adapters = AdapterTable(config.lora.enabled, executor.add_lora, executor.remove_lora)
        for lr in configured_adapters(config.lora):
            try:
                self.adapters.add(lr)
            except ValueError as e:
                raise ConfigError("lora.modules", f"{lr.lora_name}={lr.lora_path}", "",
                                  message=str(e)) from None
        self._observers: list[StepObserver] = []
        self._num_steps = 0
        # Batches in flight, oldest first (only with max_concurrent_batches > 1).
        self._max_batches = max(1, executor.max_concurrent_batches)
        self._batch_queue: deque[_InFlightBatch] = deque()
        # When the last step's output came back (engine clock), while requests were left: the
        # loop went straight on, so the next step's measured time runs from there (None: it
        # waited, or batches overlap and a step's time is not one period).
        self._last_step_end: float | None = None
        # Per-step stats as a Chrome trace (observability.trace_file): an observer like any.
        trace = StepTrace.from_config(config.observability)
        if trace is not None:
            self.add_step_observer(trace)

    # -- public facts and the observer API (llmkit/engine/observe/observer.py) -------------
    @property
    def model_facts(self) -> ModelFacts:
        """The served model's limits: max_model_len, vocab_size, EOS ids."""
        return self.executor.model_facts

    @property
    def backend_info(self) -> BackendInfo:
        """How the executor computes (attention backend, ops, linear methods, dtype, step
        graphs), for logs and benchmark results."""
        return self.executor.backend_info

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer.on_step(StepEvent)`` after every step from now on."""
        if not callable(getattr(observer, "on_step", None)):
            raise TypeError(f"a step observer needs an on_step(event) method; got "
                            f"{type(observer).__name__}")
        if observer not in self._observers:
            self._observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer`` (its ``close`` is not called). Unknown ones are ignored."""
        if observer in self._observers:
            self._observers.remove(observer)

    @property
    def step_observers(self) -> tuple[StepObserver, ...]:
        return tuple(self._observers)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (pinned ones stay). Refused, returning False with a
        warning, while requests hold blocks: their blocks cannot be dropped under them."""
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: %d requests still hold KV blocks; finish or "
                       "abort them first", self.scheduler.get_num_unfinished_requests())
        return False

    # -- LoRA adapters (llmkit/lora/adapters.py) -------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and load it in the workers (which check its files against the
        model). Returns False if it was already registered. Raises ``ValueError`` (a
        ``LoRALoadError`` for bad files) when LoRA is off, or the id or name is another
        adapter's."""
        return self.adapters.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter; the workers forget it once no unfinished request uses it.
        Returns False if it was not registered."""
        return self.adapters.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.list()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        lora_id = request.lora_id
        if lora_id is not None:
            request.lora_name = self.adapters.name_of(request.request_id, lora_id)
        self.scheduler.add_request(request)
        if lora_id is not None:  # released by the request's final output
            self.adapters.hold(request.request_id, lora_id)

    def add_requests(self, requests: Iterable[Request]) -> None:
        """One user request's engine requests (``SteppedEngineClient``'s entry)."""
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort(request_ids)
        if self._lora and self.adapters.in_use:
            self.adapters.release(outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    @property
    def num_batches_in_flight(self) -> int:
        """Batches sent to the executor whose output has not been taken yet."""
        return len(self._batch_queue)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; return every request's new tokens and finishes. With a
        batch queue, a step that only sent a batch returns nothing (the next takes it).

        One step function for both executors: one step at a time is a batch queue of one,
        whose batch runs as it is sent. Observers, when there are any, get the step's timings
        and a ``StepEvent`` once its output is taken; an observer that raises fails the step
        (as any part of the step would)."""
        queue = self._batch_queue
        if len(queue) < self._max_batches and self.scheduler.has_unfinished_requests():
            perf = time.perf_counter
            t0 = perf()
            c0 = self.clock()
            so = self.scheduler.schedule()
            t1 = perf()
            # Before the update: a request that finishes in this step leaves the scheduler in it.
            split = (split_prefill_decode(so, self.scheduler.get_request)
                     if self._observers else None)
            t2 = perf()
            result = self._send(so)
            # Nothing to compute with batches in flight: take the oldest instead.
            if result is not None or not queue:
                queue.append(_InFlightBatch(_nothing_computed() if result is None else result, so,
                                            self._num_steps, t0, t1 - t0, split, perf() - t2,
                                            c0))
                self._num_steps += 1
                if len(queue) < self._max_batches and so.total_num_scheduled_tokens:
                    return []  # room for another batch: schedule it before waiting on this one
        if not queue:
            return []
        return self._finish(queue.popleft())

    def _send(self, so: SchedulerOutput) -> ModelRunnerOutput | StepFuture | None:
        """Hand the step to the executor; None when it has nothing to do."""
        if not so.total_num_scheduled_tokens:  # is_empty, read as the field: a call less a step
            if self.kv_connector is not None:
                # Nothing to compute, but transfers to start or to poll; do not spin flat out.
                if so.kv_connector_metadata is None:
                    time.sleep(0.001)
            elif not (so.finished_req_ids or so.preempted_req_ids):
                # (the runner must hear of finished and preempted requests even then)
                return None
        if self._max_batches > 1:
            return self.executor.execute_model(so, non_block=True)
        return self.executor.execute_model(so)

    def _finish(self, batch: _InFlightBatch) -> list[EngineCoreOutput]:
        """Take a batch's output and update from it (then tell the observers)."""
        perf = time.perf_counter
        t2 = perf()
        result = batch.result
        runner_output = result if isinstance(result, ModelRunnerOutput) else result.result()
        t3 = perf()
        so = batch.scheduler_output
        # The step's measured time, as its requests see it between two tokens: from the last
        # output to this one when the loop went straight on (the update, the process's
        # messages, scheduling and the forward), else from its start.
        now = self.clock()
        step_s = None
        if self._max_batches == 1:
            last = self._last_step_end
            step_s = now - (batch.clock_s if last is None else last)
        outputs = self.scheduler.update_from_output(so, runner_output, step_s=step_s)
        # (a step that computed nothing: what follows may wait, e.g. for a KV transfer)
        self._last_step_end = (now if so.total_num_scheduled_tokens
                               and self.scheduler.has_unfinished_requests() else None)
        if self._lora and self.adapters.in_use:
            self.adapters.release(outputs)
        if runner_output.draft_token_ids or self._speculative:
            # Also an empty dict: drafts are for the next step only.
            self.scheduler.update_draft_token_ids(runner_output.draft_token_ids)
        if self._observers:
            event = StepEvent(step=batch.step, start_s=batch.start_s,
                              schedule_s=batch.schedule_s, execute_s=batch.send_s + t3 - t2,
                              update_s=perf() - t3, scheduler_output=so,
                              runner_output=runner_output, outputs=outputs,
                              stats=self.scheduler.stats(), split=batch.split)
            for observer in tuple(self._observers):
                observer.on_step(event)
        return outputs

    def request_states(self) -> list[RequestState]:
        """Every request the engine holds, running first then in arrival order."""
        names = {RequestStatus.WAITING: "waiting", RequestStatus.WAITING_FOR_FSM: "waiting",
                 RequestStatus.WAITING_FOR_REMOTE_KVS: "waiting",
                 RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}
        kv = self.kv_cache_manager
        reqs = sorted(self.scheduler.unfinished_requests(),
                      key=lambda r: (r.status != RequestStatus.RUNNING, r.arrival_index))
        return [RequestState(r.request_id, names.get(r.status, "finished"), r.num_prompt_tokens,
                             r.num_computed_tokens, r.num_output_tokens,
                             kv.num_blocks_held(r.request_id), r.arrival_index)
                for r in reqs]

    def kv_state(self) -> KVState:
        kv = self.kv_cache_manager
        return KVState(kv.num_blocks, kv.num_free_blocks, kv.num_prefix_cached_blocks)

    def check_kv_integrity(self) -> None:
        """Raise ``KVCacheIntegrityError`` if the KV bookkeeping is inconsistent (O(blocks))."""
        self.kv_cache_manager.check_integrity()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def _flush_kv_connector(self) -> None:
        """Hand the connector the pool's cached blocks one last time (a disk tier keeps
        them for the next engine) and run that work on the worker."""
        if self.kv_connector is None:
            return
        meta = self.kv_connector.shutdown_meta(self.kv_cache_manager.cached_blocks())
        if meta is not None:
            self.executor.execute_model(SchedulerOutput(
                scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                finished_req_ids=set(), preempted_req_ids=set(), kv_connector_metadata=meta))

    def shutdown(self) -> None:
        try:
            self._flush_kv_connector()
        except Exception:  # a failed flush loses only cached KV: never block the shutdown
            logger.exception("kv connector: flushing the KV cache at shutdown failed")
        try:
            for observer in self._observers:
                close = getattr(observer, "close", None)
                if callable(close):
                    close()
        finally:
            self.structured_output_manager.shutdown()
            self.executor.shutdown()
            if self.kv_connector is not None:
                self.kv_connector.shutdown()
