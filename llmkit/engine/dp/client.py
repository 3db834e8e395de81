"""``DPClient``: ``parallel.data_parallel_size`` engine cores behind one front end (vLLM's
DPLBAsyncMPClient, with its coordinator's load counts taken from each core's own stats).

Each engine core is an ``MPClient`` (its own process, executor, KV pool and scheduler, placed
on its share of the machine by ``placement``). ``DPClient`` has ``MPClient``'s interface,
so ``AsyncLLM`` (and through it ``llmkit serve``) and the offline ``LLM`` (``engine``) drive
N cores as they drive one:

- a new user request (all its ``n`` samples together) goes to the core ``DPRouter`` picks
  (load, prefix affinity, fallback: ``router``); everything else about it — aborts,
  stop-string aborts, its outputs, its structured-output grammar, its LoRA adapter — stays with
  that core;
- outputs from every core reach the one ``on_message`` handler, their stats replaced by the
  sum over the cores (``stats``); ``per_core_stats`` keeps each core's latest;
- LoRA utility calls go to every core (each loads the adapter); the live view's step summaries
  and snapshots are engine core 0's;
- a core that dies fails the requests it owned (``on_requests_lost``, else ``on_death``) with an
  ``EngineDeadError`` naming it, and makes the client dead (``/health`` 503, new requests
  refused); requests on the other cores finish. ``restart_dead_cores`` starts new processes
  in the dead ones' places (``server.restart_engine``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Iterable

from llmkit.config.schema import EngineConfig
from llmkit.engine.process.client import (EncodedRequests, EngineCoreHandlers, EngineDeadError,
                                          EngineStartupError, MPClient, start_engine_core,
                                          with_resolved_model)
from llmkit.engine.process.core import EngineCoreOutputs, EngineCoreRequest, EngineReady
from llmkit.engine.dp.placement import (CorePlacement, check_data_parallel_config,
                                        core_config, plan_placements)
from llmkit.engine.dp.router import DPRouter, prefix_keys
from llmkit.engine.dp.stats import combine_scheduler_stats
from llmkit.scheduler.base import SchedulerStats

__all__ = ["DPClient", "start_engine_cores"]

logger = logging.getLogger(__name__)


class DPClient(EngineCoreHandlers):
    """N engine core processes behind ``MPClient``'s interface, ``EngineProcessClient`` (see
    the module docstring)."""

    def __init__(self, config: EngineConfig, *, wait: bool = True,
                 startup_timeout: float = 900.0, router: DPRouter | None = None) -> None:
        check_data_parallel_config(config)
        self.config = config
        self.placements: list[CorePlacement] = plan_placements(config)
        n = len(self.placements)
        self.router = router or DPRouter(n, block_size=config.kv_cache.block_size)
        self._lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._closed = False
        self.per_core_stats: list[SchedulerStats | None] = [None] * n
        self.num_blocks: list[int] = [1] * n  # each core's KV pool (known once ready)
        self.ready: EngineReady | None = None
        self.cores: list[MPClient] = []
        self._replacing: list[MPClient] = []  # new processes of dead cores, while they load
        try:
            for p in self.placements:
                logger.info("data parallel: engine core %d of %d: %s", p.index, n, p.describe())
                self.cores.append(MPClient(core_config(config, p), wait=False, placement=p))
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        self.set_handlers(None, None)  # the router hears the cores' stats from the start
        if wait:
            self.wait_ready(startup_timeout)

    # -- set-up -----------------------------------------------------------------------------
    def _handlers_set(self) -> None:
        for i, core in enumerate(self.cores):
            self._bind(i, core)

    def _bind(self, index: int, core: MPClient) -> None:
        core.set_handlers(on_message=lambda msg: self._core_message(index, msg),
                          on_death=lambda err: self._core_death(index, err),
                          on_summary=self._on_summary if index == 0 else None)

    def wait_ready(self, timeout: float = 900.0) -> EngineReady:
        if self.ready is not None:
            return self.ready
        try:
            for i, core in enumerate(self.cores):
                try:
                    core.wait_ready(timeout)
                except EngineStartupError as e:
                    raise EngineStartupError(f"engine core {i} of {len(self.cores)}: {e}") \
                        from None
        except BaseException:
            self.shutdown(timeout=2.0)
            raise
        first = self.cores[0]
        self.ready = first.ready
        self.pid = first.pid
        self.max_model_len = first.max_model_len
        self.eos_token_id = first.eos_token_id
        self.model_facts = first.model_facts
        self.num_blocks = [c.ready.num_blocks for c in self.cores]
        logger.info("data parallel: %d engine cores ready (pids %s, %s KV blocks)",
                    len(self.cores), ", ".join(map(str, self.pids)),
                    " + ".join(map(str, self.num_blocks)))
        return self.ready

    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.cores]

    def core_states(self) -> list[tuple[bool, SchedulerStats | None]]:
        """Each core's (alive, latest stats), for ``/metrics``'s per-engine series."""
        return [(not c.is_dead, self.per_core_stats[i]) for i, c in enumerate(self.cores)]

    # -- what the cores send (their reader threads) -----------------------------------------
    def _core_message(self, index: int, msg: EngineCoreOutputs) -> None:
        with self._lock:
            if msg.stats is not None:
                self.per_core_stats[index] = msg.stats
                self.router.report(index, msg.stats.num_waiting, msg.stats.num_running)
            done = [o.request_id for o in msg.outputs if o.finish_reason is not None]
            self.router.finished(done + list(msg.errors))
            if msg.stats is not None:
                msg.stats = combine_scheduler_stats(self.per_core_stats, self.num_blocks)
        if self._on_message is not None:
            self._on_message(msg)

    def _core_death(self, index: int, err: EngineDeadError) -> None:
        named = self._named(index, err)
        with self._lock:
            lost = self.router.mark_dead(index)
            if self._dead is None:
                self._dead = named
        logger.error("%s; its %d request(s) in flight fail, /health reports 503", named,
                     len(lost))
        if self._on_lost is not None:
            self._on_lost(lost, named)
        elif self._on_death is not None:
            self._on_death(named)

    # -- state ------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        """True once any engine core has died."""
        return self._dead is not None or any(c.is_dead for c in self.cores)

    @property
    def dead_error(self) -> EngineDeadError | None:
        if self._dead is not None:
            return self._dead
        return next((self._named(i, c.dead_error) for i, c in enumerate(self.cores)
                     if c.dead_error is not None), None)

    def _named(self, index: int, err: BaseException) -> EngineDeadError:
        return EngineDeadError(f"engine core {index} of {len(self.cores)} "
                               f"(pid {self.cores[index].proc.pid}) died: {err}")

    # -- requests ---------------------------------------------------------------------------
    def encode(self, msg) -> bytes:
        return self.cores[0].encode(msg)

    def encode_requests(self, requests: list[EngineCoreRequest]) -> EncodedRequests:
        enc = self.cores[0].encode_requests(requests)
        enc.prefix_keys = request_prefix_keys(requests[0], self.router) if requests else []
        return enc

    def send_requests(self, encoded: EncodedRequests) -> None:
        if self._dead is not None:
            raise self._dead
        with self._lock:
            index = self.router.route(encoded.request_ids, encoded.prefix_keys)
        core = self.cores[index]
        try:
            for data in encoded.payloads:
                core.send_encoded(data)
        except BaseException:
            with self._lock:
                self.router.finished(encoded.request_ids)
            raise

    def add_request(self, request: EngineCoreRequest) -> None:
        self.send_requests(self.encode_requests([request]))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                owner = self.router.owner(rid)
                if owner is not None:
                    by_core.setdefault(owner, []).append(rid)
        for index, ids in by_core.items():
            self.cores[index].abort_requests(ids)

    def call_utility(self, method: str, *args) -> concurrent.futures.Future:
        """Run the utility on every core (LoRA adapters are loaded by each); the future holds
        engine core 0's result, or the first error any core raised."""
        futures = [c.call_utility(method, *args) for c in self.cores]
        combined: concurrent.futures.Future = concurrent.futures.Future()
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                combined.set_exception(errors[0])
            else:
                combined.set_result(futures[0].result())

        for f in futures:
            f.add_done_callback(one_done)
        return combined

    def request_snapshot(self, query_id: int, check_kv: bool = False) -> None:
        """Engine core 0's state now (the live view shows core 0)."""
        if self._dead is not None:
            raise self._dead
        self.cores[0].request_snapshot(query_id, check_kv)

    # -- restart (server.restart_engine) -------------------------------------------------
    def restart_dead_cores(self, timeout: float = 900.0) -> int:
        """Start a new process for every dead engine core (same config, same placement),
        wait until it is ready and put it in the dead one's place; returns how many.
        Blocking. Raises ``EngineStartupError`` if one fails to start (it stays dead)."""
        dead = [i for i, c in enumerate(self.cores) if c.is_dead]
        for i in dead:
            p = self.placements[i]
            new = MPClient(core_config(self.config, p), wait=False, placement=p)
            self._replacing.append(new)
            try:
                self._bind(i, new)
                new.wait_ready(timeout)
            finally:
                self._replacing.remove(new)
            if self._closed:  # shut down while it loaded
                new.shutdown(2.0)
                raise EngineDeadError("the engine is shutting down")
            with self._lock:
                old, self.cores[i] = self.cores[i], new
                self.router.revive(i)
                self.per_core_stats[i] = None
                self.num_blocks[i] = new.ready.num_blocks
                if i == 0:
                    self.ready, self.pid = new.ready, new.pid
                if not any(c.is_dead for c in self.cores):
                    self._dead = None
            logger.info("data parallel: engine core %d restarted (pid %s)", i, new.pid)
            old.shutdown(1.0)
        return len(dead)

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every engine core (ask them all, then wait). Idempotent."""
        if self._closed:
            return
        self._closed = True
        threads = [threading.Thread(target=c.shutdown, args=(timeout,), daemon=True)
                   for c in [*self.cores, *self._replacing]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10.0)


def request_prefix_keys(request: EngineCoreRequest, router: DPRouter) -> list[int]:
    """The router's prefix keys of a request: its first full blocks, rooted in what also
    separates KV in the prefix cache (adapter, salt, images)."""
    lora = request.lora_request.lora_int_id if request.lora_request is not None else None
    images = tuple(f.identifier for f in request.mm_features) if request.mm_features else ()
    return prefix_keys(request.prompt_token_ids, router.block_size, router.affinity_blocks,
                       root=(lora, request.cache_salt, images))


def start_engine_cores(config: EngineConfig) -> MPClient | DPClient:
    """Start the engine core(s) of ``config`` without waiting for them to be ready: one
    ``MPClient``, or a ``DPClient`` of ``parallel.data_parallel_size`` cores."""
    if config.parallel.data_parallel_size == 1:
        return start_engine_core(config)
    check_data_parallel_config(config)  # before fetching a model
    return DPClient(with_resolved_model(config), wait=False)

