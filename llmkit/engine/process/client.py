"""Clients of the engine core: in this process (offline use), or in its own process over ZMQ.

Both take ``EngineCoreRequest``s and abort lists and hand back ``EngineCoreOutputs``:

- ``InprocClient`` wraps an ``EngineCore``; the caller drives it with ``step()``.
- ``MPClient`` spawns ``core.run_engine_core`` (``multiprocessing`` spawn context) and
  talks to it over two IPC sockets with msgpack. A reader thread blocks on the output socket
  and on the process's sentinel, so it hears of outputs and of the engine's death at once and
  never spins; it hands each message to ``on_message``, and each step summary to
  ``on_summary`` (both called in the reader thread).
  ``shutdown()`` asks the engine to stop, then terminates and finally kills it; an ``atexit``
  hook does the same if the owner forgets, so no engine process outlives its parent.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import msgspec
import zmq

from llmkit.config.openmp_env import likely_cuda, openmp_env_for_children
from llmkit.config.schema import EngineConfig
from llmkit.engine.process.core import (UTILITY_METHODS, AbortRequests, EngineCoreOutputs,
                                        EngineCoreRequest, EngineFailed, EngineMessage, EngineReady,
                                        ShutdownEngine, UtilityCall, UtilityResult,
                                        decode_sampling_params, make_encoder, run_engine_core)
from llmkit.engine.observe.step_summary import EngineSnapshotQuery, EngineStepSummary
from llmkit.executor.worker_launch import hide_main_if_needed
from llmkit.facts import ModelFacts

if TYPE_CHECKING:
    from llmkit.engine.dp.placement import CorePlacement

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone; requests in flight cannot finish."""


class EngineStartupError(RuntimeError):
    """The engine core process failed before it was ready (bad config, model, memory)."""


@dataclass(slots=True)
class EncodedRequests:
    """The engine requests of one user request (its ``n`` samples), encoded for the core;
    ``prefix_keys``: what a data-parallel router keeps together (empty for one core)."""

    request_ids: list[str]
    payloads: list[bytes]
    prefix_keys: list[int] = field(default_factory=list)


# What a client of engine core process(es) reports through: outputs and step summaries (called
# in a reader thread), the engine's death, and (several cores) the requests a dead core took.
OnMessage = Callable[[EngineCoreOutputs], None]
OnDeath = Callable[[EngineDeadError], None]
OnSummary = Callable[[EngineStepSummary], None]
OnRequestsLost = Callable[[list[str], EngineDeadError], None]


class EngineCoreHandlers:
    """The callbacks of a client of engine core processes (``MPClient``, ``DPClient``), set
    together by ``set_handlers``."""

    _on_message: OnMessage | None = None
    _on_death: OnDeath | None = None
    _on_summary: OnSummary | None = None
    _on_lost: OnRequestsLost | None = None

    def set_handlers(self, on_message: OnMessage | None, on_death: OnDeath | None,
                     on_summary: OnSummary | None = None,
                     on_requests_lost: OnRequestsLost | None = None) -> None:
        """Set the callbacks (before ``wait_ready``, which starts the reader threads).
        ``on_requests_lost(ids, err)``: an engine core died with these engine requests in
        flight; only a client of several cores (``DPClient``) calls it, and without it
        ``on_death`` hears of it. One core's death is the engine's (``on_death``)."""
        self._on_message, self._on_death = on_message, on_death
        self._on_summary, self._on_lost = on_summary, on_requests_lost
        self._handlers_set()

    def _handlers_set(self) -> None:
        """Pass the new callbacks on (to the clients this one is made of)."""


# --------------------------------------------------------------------------- in process

class InprocClient:
    """The engine core in this process: ``add_request`` / ``abort_requests`` / ``step``."""

    def __init__(self, config: EngineConfig, **engine_kwargs) -> None:
        from llmkit.engine.loop.core import EngineCore

        self.core = EngineCore(config, **engine_kwargs)
        self.max_model_len = self.core.max_model_len
        self.eos_token_id = self.core.eos_token_id
        self.model_facts = self.core.model_facts

    def add_request(self, request: EngineCoreRequest) -> None:
        from llmkit.request import Request

        params = decode_sampling_params(request.sampling_params)
        lora_id = None
        if request.lora_request is not None:
            self.core.add_lora(request.lora_request)
            lora_id = request.lora_request.lora_int_id
        self.core.add_request(Request(request.request_id, request.prompt_token_ids, params,
                                      eos_token_id=self.core.eos_token_id,
                                      arrival_time=self.core.clock(),
                                      priority=request.priority, cache_salt=request.cache_salt,
                                      lora_id=lora_id, mm_features=request.mm_features))

    def call_utility(self, method: str, *args) -> Any:
        return UTILITY_METHODS[method](self.core, *args)

    def abort_requests(self, request_ids: Iterable[str]) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.core.abort_requests(list(request_ids)),
                                 stats=self.core.stats())

    def step(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.core.step(), stats=self.core.stats())

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def shutdown(self) -> None:
        self.core.shutdown()


# --------------------------------------------------------------------------- own process

class MPClient(EngineCoreHandlers):
    """The engine core in a child process (an ``EngineProcessClient``). Construction blocks until the engine is ready
    (model loaded, KV cache allocated) and raises ``EngineStartupError`` if it is not."""

    def __init__(self, config: EngineConfig, *,
                 on_message: OnMessage | None = None, on_death: OnDeath | None = None,
                 startup_timeout: float = 900.0, log_level: int | None = None,
                 wait: bool = True, placement: "CorePlacement | None" = None) -> None:
        self.config = config
        self.placement = placement
        self.set_handlers(on_message, on_death)
        self._closed = False
        self._stopping = False
        self._dead: EngineDeadError | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="llmkit-ipc-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.Context()
        # Sends never block: an unlimited queue (messages are small; the engine drains it).
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._encoder = make_encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._send_lock = threading.Lock()
        # Utility calls in flight: call id -> the future their UtilityResult resolves.
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()

        if log_level is None:
            log_level = logging.getLogger("llmkit").getEffectiveLevel()
        spawn = multiprocessing.get_context("spawn")
        where: dict[str, Any] = {}
        if placement is not None:  # one of several data-parallel engine cores
            where = dict(engine_index=placement.index,
                         cpus=list(placement.cpus) if placement.cpus else None,
                         env={} if placement.cuda_visible_devices is None else
                         {"CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices})
        self.proc = spawn.Process(
            target=run_engine_core, name="llmkit-engine-core" + (
                f"-{placement.index}" if placement is not None else ""),
            kwargs=dict(config=config.model_dump(mode="json", by_alias=True),
                        input_address=input_address, output_address=output_address,
                        parent_pid=os.getpid(), log_level=log_level, **where))
        # Whatever happens to the owner, the engine process goes with it at interpreter exit
        # (before multiprocessing's own atexit hook, which would wait for it forever).
        atexit.register(self.shutdown)
        # The child may load torch before run_engine_core runs (spawn re-imports the parent's
        # __main__), so its OpenMP wait policy must be in the environment it starts with. A
        # __main__ that would run the user's engine again, or that is no file (stdin), is not
        # re-imported at all (llmkit/executor/worker_launch.py).
        with openmp_env_for_children(not likely_cuda(config.platform.name)), \
                hide_main_if_needed():
            self.proc.start()
        self.ready: EngineReady | None = None
        self._reader: threading.Thread | None = None
        if wait:
            self.wait_ready(startup_timeout)

    def wait_ready(self, timeout: float = 900.0) -> EngineReady:
        """Block until the engine has loaded the model (construction with ``wait=False``
        lets the caller do other start-up work meanwhile)."""
        if self.ready is not None:
            return self.ready
        try:
            self.ready = self._wait_ready(timeout)
        except BaseException:
            self.shutdown(timeout=2.0)
            raise
        self.pid = self.ready.pid
        self.max_model_len = self.ready.max_model_len
        self.eos_token_id = self.ready.eos_token_id
        self.model_facts = ModelFacts(max_model_len=self.ready.max_model_len,
                                      vocab_size=self.ready.vocab_size,
                                      eos_token_id=self.ready.eos_token_id,
                                      eos_token_ids=tuple(self.ready.eos_token_ids))
        self._reader = threading.Thread(target=self._read_loop, name="llmkit-engine-output",
                                        daemon=True)
        self._reader.start()
        return self.ready

    # -- start-up --------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"the engine core was not ready within {timeout:.0f} s")
            events = dict(poller.poll(min(left, 1.0) * 1000))
            if self._output in events:
                msg = self._decoder.decode(self._output.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    raise EngineStartupError(f"the engine core failed to start: {msg.message}")
            elif self.proc.sentinel in events or not self.proc.is_alive():
                self.proc.join(1.0)
                raise EngineStartupError(
                    f"the engine core process exited during start-up (exit code "
                    f"{self.proc.exitcode}); see its log above")

    # -- the output side (reader thread) ----------------------------------------------------
    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        failure: str | None = None
        while not self._closed:
            try:
                events = dict(poller.poll(500))
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            if self._output in events:
                failure = self._drain_outputs() or failure
            if self._closed:
                return
            if failure is not None or self.proc.sentinel in events:
                # The engine is gone (or going): deliver what it sent last, then report.
                time.sleep(0.05)
                failure = self._drain_outputs() or failure
                if self._stopping:
                    return
                self.proc.join(1.0)
                why = failure or f"exit code {self.proc.exitcode}"
                self._dead = EngineDeadError(f"the engine core process died ({why})")
                logger.error("%s; requests in flight fail, /health reports 503", self._dead)
                for fut in list(self._calls.values()):
                    fut.set_exception(self._dead)
                self._calls.clear()
                if self._on_death is not None:
                    self._on_death(self._dead)
                return

    def _drain_outputs(self) -> str | None:
        failure = None
        while True:
            try:
                data = self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                return failure
            except zmq.ZMQError:
                return failure
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as e:
                logger.error("dropped an undecodable message from the engine core: %s", e)
                continue
            if isinstance(msg, EngineFailed):
                failure = msg.message
            elif isinstance(msg, UtilityResult):
                self._resolve(msg)
            elif isinstance(msg, EngineCoreOutputs) and self._on_message is not None:
                try:
                    self._on_message(msg)
                except Exception:  # noqa: BLE001 - the reader must survive a bad handler
                    logger.exception("handling engine core outputs failed")
            elif isinstance(msg, EngineStepSummary) and self._on_summary is not None:
                try:
                    self._on_summary(msg)
                except Exception:  # noqa: BLE001
                    logger.exception("handling an engine step summary failed")

    # -- the input side ---------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        """True once the reader thread has seen the process end (within milliseconds)."""
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    def core_states(self) -> list:
        return []  # one core: its state is the engine's

    def encode(self, msg) -> bytes:
        """msgpack bytes of an input message (raises for values that cannot cross)."""
        return self._encoder.encode(msg)

    def send_encoded(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        self._send_bytes(data)

    def _send(self, msg) -> None:
        self._send_bytes(self._encoder.encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        if self._closed:
            raise EngineDeadError("the engine core has been shut down")
        with self._send_lock:
            try:
                self._input.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # no pipe to the engine (yet): wait a little, never forever
                pass
            # A dead engine (not yet seen by the reader thread) must not hold the caller —
            # the event loop — for the second below.
            if not self.proc.is_alive():
                raise EngineDeadError("the engine core process is gone")
            if not self._input.poll(1000, zmq.POLLOUT):
                raise EngineDeadError("the engine core does not accept messages")
            self._input.send(data, zmq.NOBLOCK, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.send_encoded(self.encode(request))

    def encode_requests(self, requests: list[EngineCoreRequest]) -> EncodedRequests:
        """Encode one user request's engine requests (raises for values that cannot cross,
        before anything is sent)."""
        return EncodedRequests([r.request_id for r in requests],
                               [self._encoder.encode(r) for r in requests])

    def send_requests(self, encoded: EncodedRequests) -> None:
        for data in encoded.payloads:
            self.send_encoded(data)

    def call_utility(self, method: str, *args) -> concurrent.futures.Future:
        """Run ``UTILITY_METHODS[method](core, *args)`` in the engine process; the future
        holds its result, or the error it raised (``ValueError`` for bad input, with the
        engine's message), or ``EngineDeadError``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(self._dead)
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, list(args)))
        except Exception as e:  # noqa: BLE001 - reported through the future
            self._calls.pop(call_id, None)
            fut.set_exception(e)
        return fut

    def _resolve(self, msg: UtilityResult) -> None:
        fut = self._calls.pop(msg.call_id, None)
        if fut is None:
            return
        if msg.error is None:
            fut.set_result(msg.result)
        elif msg.error_type in ("ValueError", "LoRALoadError", "ConfigError", "TypeError"):
            fut.set_exception(ValueError(msg.error))
        else:
            fut.set_exception(RuntimeError(f"{msg.error_type}: {msg.error}"))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and not self._closed and self._dead is None:
            self._send(AbortRequests(ids))

    def request_snapshot(self, query_id: int, check_kv: bool = False) -> None:
        """Ask for an ``EngineStepSummary`` of the state now (it arrives with ``query_id``
        through ``on_summary``)."""
        if self._dead is not None:
            raise self._dead
        self._send(EngineSnapshotQuery(query_id, check_kv))

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine: ask, wait ``timeout`` s, terminate, kill. Idempotent."""
        if self._closed or self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        proc = self.proc
        try:
            if proc.pid is not None and proc.exitcode is None:
                if self._dead is None:
                    try:
                        self._send(ShutdownEngine())
                    except (zmq.ZMQError, EngineDeadError):
                        timeout = 0.0  # it cannot hear us: terminate it
                proc.join(timeout)
            if proc.pid is not None and proc.exitcode is None:
                logger.warning("the engine core did not stop within %.0f s; terminating it",
                               timeout)
                proc.terminate()
                proc.join(3.0)
            if proc.pid is not None and proc.exitcode is None:
                proc.kill()
                proc.join(3.0)
        except (AssertionError, ValueError, OSError):  # not our child / not started
            pass
        finally:
            self._closed = True
            for fut in list(self._calls.values()):
                if not fut.done():
                    fut.set_exception(EngineDeadError("the engine core has been shut down"))
            self._calls.clear()
            reader = self._reader
            if reader is not None and reader is not threading.current_thread():
                reader.join(2.0)
            self._input.close(linger=0)
            self._output.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def with_resolved_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model.path`` naming the model's files (a preset is fetched here)."""
    path = config.model.path
    if path is None:
        from llmkit.models.default_model import resolve_default_model
        path = str(resolve_default_model(config.model))
    return config.model_copy(update={"model": config.model.model_copy(update={"path": path})})


def start_engine_core(config: EngineConfig) -> MPClient:
    """Start the engine process for ``config`` without waiting for it to be ready (call
    ``wait_ready``, or hand it to ``AsyncLLM.from_config(..., engine_core=...)``). The engine
    gets the resolved model path: a preset is fetched once, here. (Several data-parallel
    engine cores: ``llmkit.engine.dp.client.start_engine_cores``.)"""
    return MPClient(with_resolved_model(config), wait=False)
