"""EngineCore: the control-plane loop. schedule → execute → update, on token ids only."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from llmkit.config.schema import EngineConfig
from llmkit.engine.components import validate_components
from llmkit.engine.observer import (KVState, RequestState, StepEvent, StepObserver,
                                    split_prefill_decode)
from llmkit.engine.step_trace import StepTrace
from llmkit.executor import BackendInfo, Executor, ModelFacts, executor_class
from llmkit.kv_cache import KV_CACHE_MANAGERS
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.platforms import resolve_platform
from llmkit.request import Request, RequestStatus
from llmkit.scheduler import SCHEDULERS, Scheduler, SchedulerOutput, SchedulerStats
from llmkit.startup import startup_step
from llmkit.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, *, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, **executor_kwargs) -> None:
        validate_components(config)
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
            tokenizer_loader=lambda: self._tokenizer(model_source))
        sched_cls = SCHEDULERS.resolve(config.scheduler.name, config.scheduler.target)
        self.scheduler: Scheduler = sched_cls(
            config.scheduler, self.kv_cache_manager, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, clock=clock,
            structured_output_manager=self.structured_output_manager)
        self.clock = clock
        self._observers: list[StepObserver] = []
        self._num_steps = 0
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

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; return every request's new tokens and finishes."""
        if not self.scheduler.has_unfinished_requests():
            return []
        if self._observers:
            return self._observed_step()
        self._num_steps += 1
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            # Still tell the runner about finished/preempted requests so it drops them.
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                return self.executor.execute_model(scheduler_output)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.executor.execute_model(scheduler_output)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
                ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.draft_token_ids:
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

    def request_states(self) -> list[RequestState]:
        """Every request the engine holds, running first then in arrival order."""
        names = {RequestStatus.WAITING: "waiting", RequestStatus.WAITING_FOR_FSM: "waiting",
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

    def shutdown(self) -> None:
        try:
            for observer in self._observers:
                close = getattr(observer, "close", None)
                if callable(close):
                    close()
        finally:
            self.structured_output_manager.shutdown()
            self.executor.shutdown()
