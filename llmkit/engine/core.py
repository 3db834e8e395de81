"""EngineCore: the control-plane loop. schedule → execute → update, on token ids only.

With an executor that keeps several steps in flight (``max_concurrent_batches`` > 1: pipeline
parallel's stages) the loop runs a batch queue (vLLM's ``step_with_batch_queue``): while the
queue has room it schedules another batch and sends it without waiting; when it is full (or
nothing more can be scheduled) it waits for the oldest batch and updates from its output. The
scheduler never puts a request in a batch while its previous one is in flight, so every
request's tokens are what one step at a time would give.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.engine.components import validate_components
from llmkit.engine.observer import (KVState, RequestState, StepEvent, StepObserver,
                                    split_prefill_decode)
from llmkit.engine.step_trace import StepTrace
from llmkit.executor import BackendInfo, Executor, ModelFacts, executor_class
from llmkit.executor.base import StepFuture
from llmkit.kv_cache import KV_CACHE_MANAGERS
from llmkit.lora.adapters import AdapterTable, configured_adapters
from llmkit.lora.request import LoRARequest
from llmkit.kv_transfer import KVConnectorBase, KVConnectorRole, KVLayout, kv_connector_class
from llmkit.kv_transfer.fingerprint import kv_fingerprint
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.platforms import resolve_platform
from llmkit.request import Request, RequestStatus
from llmkit.scheduler import (SCHEDULERS, CachedRequestData, Scheduler, SchedulerOutput,
                              SchedulerStats)
from llmkit.startup import startup_step
from llmkit.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlightBatch:
    """A batch sent to the executor whose output has not been taken yet."""

    future: StepFuture
    scheduler_output: SchedulerOutput
    step: int
    start_s: float
    schedule_s: float
    split: Any  # its BatchSplit when observers watch, else None


class EngineCore:
    def __init__(self, config: EngineConfig, *, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, **executor_kwargs) -> None:
        validate_components(config)
        if config.parallel.data_parallel_size > 1:
            raise ConfigError("parallel.data_parallel_size", config.parallel.data_parallel_size,
                              "1 for one EngineCore (several engine cores run behind LLM, "
                              "AsyncLLM and llmkit serve: llmkit.engine.dp_client)")
        self.config = config
        self.platform = resolve_platform(config.platform)
        self.platform.apply_runtime_settings()
        if executor is None:
            exec_cls = executor_class(config)
            with startup_step("loading the model"):
                executor = exec_cls(config, self.platform, **executor_kwargs)
        self.executor = executor
        facts = executor.model_facts
        self.max_model_len = facts.max_model_len
        self.eos_token_id = facts.eos_token_id
        self.num_blocks = self._num_kv_blocks()
        # KV connector (kv_transfer / kv_offload): its worker side first, since it may own
        # the pool's memory.
        self.kv_connector: KVConnectorBase | None = None
        conn_cls = kv_connector_class(config)
        if conn_cls is not None:
            layout = self._kv_layout(executor_kwargs.get("model_source"))
            executor.init_kv_connector(conn_cls, layout)
            self.kv_connector = conn_cls(config, KVConnectorRole.SCHEDULER, layout)
        with startup_step("allocating the KV cache"):
            executor.initialize_kv_cache(self.num_blocks)
        kv_cfg = config.kv_cache
        kv_cls = KV_CACHE_MANAGERS.resolve(kv_cfg.name, kv_cfg.target)
        self.kv_cache_manager = kv_cls(self.num_blocks, kv_cfg.block_size,
                                       enable_prefix_caching=kv_cfg.enable_prefix_caching,
                                       max_model_len=self.max_model_len,
                                       eviction_policy=kv_cfg.eviction_policy,
                                       pinned_prefixes=self._pinned_prefix_ids())
        # Grammars compile in its thread pool; its tokenizer loads with the first grammar.
        model_source = executor_kwargs.get("model_source")
        self.structured_output_manager = StructuredOutputManager(
            config.structured_output, vocab_size=facts.vocab_size,
            tokenizer_loader=lambda: self._tokenizer(model_source),
            # a step's bitmask walks a request's drafts through its matcher and takes them back
            max_rollback_tokens=config.speculative.num_speculative_tokens
            if config.speculative.enabled else 0)
        sched_cls = SCHEDULERS.resolve(config.scheduler.name, config.scheduler.target)
        sched_kwargs = {}
        if config.speculative.name == "eagle":
            sched_kwargs["drop_last_cached_block"] = True
        if config.lora.enabled:
            self._check_lora_support(executor, sched_cls)
            sched_kwargs.update(max_loras=config.lora.max_loras,
                                max_lora_skips=config.lora.max_skipped_steps)
        pp = config.parallel.pipeline_parallel_size
        if pp > 1:
            sched_kwargs["pipeline_parallel_size"] = pp
        if self.kv_connector is not None:
            self.kv_connector.bind_block_hasher(self.kv_cache_manager.ensure_block_hashes)
            pool = getattr(self.kv_cache_manager, "block_pool", None)
            if pool is not None:
                pool.eviction_listener = self.kv_connector.on_blocks_evicted
            sched_kwargs["kv_connector"] = self.kv_connector
        self.scheduler: Scheduler = sched_cls(
            config.scheduler, self.kv_cache_manager, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, clock=clock,
            structured_output_manager=self.structured_output_manager, **sched_kwargs)
        self.clock = clock
        self._speculative = config.speculative.enabled
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
        # Per-step stats as a Chrome trace (observability.trace_file): an observer like any.
        trace = StepTrace.from_config(config.observability)
        if trace is not None:
            self.add_step_observer(trace)

    # -- public facts and the observer API (llmkit/engine/observer.py) ---------------------
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

    @staticmethod
    def _check_lora_support(executor: Executor, sched_cls: type) -> None:
        if not getattr(executor, "supports_lora", False):
            raise ConfigError("lora.enabled", True, "", message=(
                f"executor {type(executor).__name__} does not serve LoRA adapters; use "
                "executor=uniproc, executor=multiproc or lora.enabled=false"))
        import inspect

        params = inspect.signature(sched_cls).parameters
        if "max_loras" not in params:
            raise ConfigError("lora.enabled", True, "", message=(
                f"scheduler {sched_cls.__name__} cannot limit the adapters of a step (its "
                "constructor takes no max_loras); use scheduler=token_budget or "
                "lora.enabled=false"))
    def _kv_layout(self, model_source=None) -> KVLayout:
        """The pool's layout and the fingerprint of the KV this engine computes: its model's
        weights and config, dtype, block size and block shape."""
        if model_source is None:
            from llmkit.models.loader import resolve_model_source
            model_source = resolve_model_source(self.config.model)
        layout = self.executor.kv_layout("")
        fp = kv_fingerprint(model_source.path, dtype=layout.dtype, block_size=layout.block_size,
                            block_shape=layout.block_shape, block_dim=layout.block_dim,
                            num_layers=layout.num_layers,
                            linear_method=self.config.model.linear_method)
        return KVLayout(layout.num_layers, layout.block_shape, layout.block_dim, layout.dtype,
                        layout.block_size, fp)

    def _pinned_prefix_ids(self) -> list[list[int]]:
        """``kv_cache.pinned_prefixes`` as token ids (text is tokenized as prompts are)."""
        kv_cfg = self.config.kv_cache
        prefixes = kv_cfg.pinned_prefixes
        if not prefixes:
            return []
        if not kv_cfg.enable_prefix_caching:
            logger.warning("kv_cache.pinned_prefixes is set but kv_cache.enable_prefix_caching is "
                           "false: nothing is cached, so nothing can be pinned")
            return []
        tokenizer = None
        ids = []
        for p in prefixes:
            if isinstance(p, str):
                if tokenizer is None:
                    from llmkit.models.loader import resolve_model_source
                    tokenizer = resolve_model_source(self.config.model).load_tokenizer()
                ids.append(tokenizer.encode(p))
            else:
                ids.append(list(p))
        return ids

    def _tokenizer(self, model_source=None):
        if model_source is None:
            from llmkit.models.loader import resolve_model_source
            model_source = resolve_model_source(self.config.model)
        return model_source.load_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (pinned ones stay). Refused, returning False with a
        warning, while requests hold blocks: their blocks cannot be dropped under them."""
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: %d requests still hold KV blocks; finish or "
                       "abort them first", self.scheduler.get_num_unfinished_requests())
        return False

    def _num_kv_blocks(self) -> int:
        kv_cfg = self.config.kv_cache
        if kv_cfg.num_blocks is not None:
            return kv_cfg.num_blocks
        per_block = self.executor.kv_cache_bytes_per_block()
        budget = self.platform.kv_cache_budget_bytes(kv_cfg.memory_gib)
        blocks_per_seq = -(-self.max_model_len // kv_cfg.block_size)
        # Never more than every sequence at full length needs: the rest would be idle memory.
        cap = blocks_per_seq * self.config.scheduler.max_num_seqs
        num = min(budget // per_block, cap)
        if num < blocks_per_seq:
            logger.warning("kv_cache.memory_gib=%s holds %d blocks of %d tokens, fewer than one "
                           "sequence of max_model_len=%d needs", kv_cfg.memory_gib, num,
                           kv_cfg.block_size, self.max_model_len)
        return max(int(num), 1)

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

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort(request_ids)
        if self.adapters.in_use:
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
        batch queue, a step that only sent a batch returns nothing (the next takes it)."""
        if self._max_batches > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return []
        if self._observers:
            return self._observed_step()
        self._num_steps += 1
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty and self.kv_connector is not None:
            # Nothing to compute, but transfers to start or to poll; do not spin flat out.
            if scheduler_output.kv_connector_metadata is None:
                time.sleep(0.001)
            return self.executor.execute_model(scheduler_output)
        if scheduler_output.is_empty:
            # Still tell the runner about finished/preempted requests so it drops them.
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                return self.executor.execute_model(scheduler_output)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.executor.execute_model(scheduler_output)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
                ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.adapters.in_use:
            self.adapters.release(outputs)
        if runner_output.draft_token_ids or self._speculative:
            # Also an empty dict: drafts are for the next step only.
            self.scheduler.update_draft_token_ids(runner_output.draft_token_ids)
        return outputs

    def _observed_step(self) -> list[EngineCoreOutput]:
        """``step`` with timings and a ``StepEvent`` for the observers. An observer that
        raises fails the step (as any part of the step would)."""
        perf = time.perf_counter
        index = self._num_steps
        self._num_steps += 1
        t0 = perf()
        scheduler_output = self.scheduler.schedule()
        t1 = perf()
        # Before the update: a request that finishes in this step leaves the scheduler in it.
        split = split_prefill_decode(scheduler_output,
                                     getattr(self.scheduler, "get_request", None))
        t2 = perf()
        runner_output = self._execute(scheduler_output)
        t3 = perf()
        outputs = self._update(scheduler_output, runner_output)
        t4 = perf()
        event = StepEvent(step=index, start_s=t0, schedule_s=t1 - t0, execute_s=t3 - t2,
                          update_s=t4 - t3, scheduler_output=scheduler_output,
                          runner_output=runner_output, outputs=outputs,
                          stats=self.scheduler.stats(), split=split)
        for observer in tuple(self._observers):
            observer.on_step(event)
        return outputs

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        queue = self._batch_queue
        perf = time.perf_counter
        observed = bool(self._observers)
        if len(queue) < self._max_batches and self.scheduler.has_unfinished_requests():
            t0 = perf()
            so = self.scheduler.schedule()
            t1 = perf()
            # The runner must hear of finished and preempted requests even in an empty batch.
            if not so.is_empty or so.finished_req_ids or so.preempted_req_ids:
                split = (split_prefill_decode(so, getattr(self.scheduler, "get_request", None))
                         if observed else None)
                future = self.executor.execute_model(so, non_block=True)
                queue.append(_InFlightBatch(future, so, self._num_steps, t0, t1 - t0, split))
                self._num_steps += 1
                if len(queue) < self._max_batches and not so.is_empty:
                    return []  # room for another batch: schedule it before waiting on this one
            elif not queue:  # nothing to compute nor to wait for (outputs of refused requests)
                return self._update(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        if not queue:
            return []
        batch = queue.popleft()
        t2 = perf()
        runner_output = batch.future.result()
        t3 = perf()
        outputs = self._update(batch.scheduler_output, runner_output)
        if observed:
            event = StepEvent(step=batch.step, start_s=batch.start_s,
                              schedule_s=batch.schedule_s, execute_s=t3 - t2,
                              update_s=perf() - t3, scheduler_output=batch.scheduler_output,
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
                             len(kv.get_block_ids(r.request_id)), r.arrival_index)
                for r in reqs]

    def kv_state(self) -> KVState:
        kv = self.kv_cache_manager
        return KVState(kv.num_blocks, kv.num_free_blocks,
                       getattr(kv, "num_prefix_cached_blocks", 0))

    def check_kv_integrity(self) -> None:
        """Raise ``KVCacheIntegrityError`` if the KV bookkeeping is inconsistent (O(blocks))."""
        self.kv_cache_manager.check_integrity()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def _flush_kv_connector(self) -> None:
        """Hand the connector the pool's cached blocks one last time (a disk tier keeps
        them for the next engine) and run that work on the worker."""
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        if pool is None or self.kv_connector is None:
            return
        cached = [(b.block_id, h) for h, b in pool.cached_block_hash_to_block.items()]
        meta = self.kv_connector.shutdown_meta(cached)
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
