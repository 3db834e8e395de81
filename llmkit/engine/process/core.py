"""The engine core in its own process (the seed's ch. 03, process B), and the messages it
exchanges with the API process over ZMQ.

Messages are msgspec structs encoded with msgpack: token ids, plain numbers and strings, never
tensors or pickled objects. Two PUSH/PULL sockets over IPC, both bound by the client:

    API process ──(EngineCoreRequest | AbortRequests | EngineSnapshotQuery | UtilityCall |
                   ShutdownEngine)──▶ engine core
    API process ◀──(EngineReady | EngineCoreOutputs | EngineStepSummary | UtilityResult |
                    EngineFailed)────── engine core

The loop (``EngineCoreProc.run``) drains its input without blocking while requests are in
flight and runs one ``EngineCore.step`` per turn; while idle it blocks on the input socket (a
1 s timeout, to notice a dead parent), so an idle engine burns no CPU. Every batch of outputs
carries the scheduler's stats snapshot (running, waiting, KV usage, prefix-cache counters,
preemptions), and an abort is answered with one at once, so the API process sees freed blocks.
Per-step summaries for live views (``observe/step_summary.py``) go out at most
``server.engine_events_per_s`` times a second, and once more when the engine goes idle; an
``EngineSnapshotQuery`` is answered between steps.
The process exits when told to, on SIGTERM, or when its parent dies; it ignores SIGINT (a
Ctrl-C in a terminal reaches the whole process group; the parent orders the shutdown).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import sys
import traceback
from typing import Any, Union

import msgspec
import zmq

from llmkit.multimodal.base import MultiModalFeatureSpec
from llmkit.engine.observe.step_summary import (EngineSnapshotQuery, EngineStepSummary,
                                                StepSummaryPublisher)
from llmkit.lora.request import LoRARequest
from llmkit.outputs import EngineCoreOutput
from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.base import SchedulerStats

logger = logging.getLogger(__name__)

# How often an idle engine wakes up to check that its parent is alive (ms).
IDLE_POLL_MS = 1000


# --------------------------------------------------------------------------- messages

class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    """A request as it crosses to the engine core: token ids and the sampling parameters as a
    plain dict (``encode_sampling_params``), so that new SamplingParams fields cross unchanged."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    priority: int = 0
    cache_salt: str | None = None
    # The adapter to compute with (loaded by the engine the first time it is named).
    lora_request: LoRARequest | None = None
    # The prompt's images: placeholder ranges, content hashes, pixel values as bytes.
    mm_features: list[MultiModalFeatureSpec] = []


class UtilityCall(msgspec.Struct, array_like=True, tag="utility"):
    """Call one of the engine core's ``UTILITY_METHODS`` (LoRA adapters); answered with a
    ``UtilityResult`` of the same ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, omit_defaults=True, tag="utility_result"):
    call_id: int
    result: Any = None
    # ``"<ExceptionType>: message"`` when the call raised.
    error: str | None = None
    error_type: str | None = None


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class ShutdownEngine(msgspec.Struct, array_like=True, tag="shutdown"):
    """Ask the engine process to stop after the current step."""


EngineInput = Union[EngineCoreRequest, AbortRequests, EngineSnapshotQuery, ShutdownEngine,
                    UtilityCall]


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once, when the model is loaded and the KV cache allocated."""

    pid: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_id: int | None = None
    # The rest of the engine's ModelFacts (the front end's input checks use them).
    vocab_size: int = 0
    eos_token_ids: list[int] = []


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine core cannot go on (start-up failed, or a step raised); it exits after this."""

    message: str


class RequestTiming(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine-side facts about a finished request (engine clock, seconds)."""

    queue_time: float | None = None  # first scheduled - arrival at the engine core
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, tag="outputs", omit_defaults=True):
    """One step's outputs (or an abort's), with the scheduler's stats after it."""

    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    # For requests that finished in this batch.
    timings: dict[str, RequestTiming] = {}
    # Requests the core refused (bad parameters, duplicate id): request id -> message.
    errors: dict[str, str] = {}


EngineMessage = Union[EngineReady, EngineFailed, EngineCoreOutputs, EngineStepSummary,
                      UtilityResult]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine core "
                              "(only plain data crosses the process boundary)")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """Every init field of the (slots) dataclass by name; the engine side rebuilds it with
    ``decode_sampling_params``. Generic on purpose: fields added to SamplingParams cross too."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def decode_sampling_params(data: dict[str, Any]) -> SamplingParams:
    # msgspec.convert restores typed fields (enums, nested dataclasses) from their msgpack
    # form; where a field's type is beyond msgspec, the constructor takes the plain values.
    try:
        return msgspec.convert(data, SamplingParams)
    except (msgspec.ValidationError, TypeError, ValueError):
        return SamplingParams(**data)


#: What a ``UtilityCall`` may run on the engine core, by name (results cross as plain data).
UTILITY_METHODS = {
    "add_lora": lambda core, name, lora_id, path: core.add_lora(
        LoRARequest(name, lora_id, path)),
    "remove_lora": lambda core, lora_id: core.remove_lora(lora_id),
    "list_loras": lambda core: [[r.lora_name, r.lora_int_id, r.lora_path]
                                for r in core.list_loras()],
}


# --------------------------------------------------------------------------- the process

class EngineCoreProc:
    """Owns an ``EngineCore`` and runs the busy loop between two ZMQ sockets."""

    def __init__(self, config, input_address: str, output_address: str,
                 parent_pid: int | None = None) -> None:
        from llmkit.engine.loop.core import EngineCore
        from llmkit.models.loader import resolve_model_source

        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 1000)
        self.output.setsockopt(zmq.SNDTIMEO, 5000)
        self.output.connect(output_address)
        self.encoder = make_encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.stop = False
        self.requests: dict[str, Any] = {}  # request id -> Request (for timings)
        try:
            source = resolve_model_source(config.model)
            self.core = EngineCore(config, model_source=source)
        except BaseException as e:
            self.send(EngineFailed(message=f"{type(e).__name__}: {e}"))
            self.input.close(linger=0)
            self.output.close(linger=2000)  # let the message out before the process ends
            self.ctx.term()
            raise
        self.summaries = StepSummaryPublisher(self.core, self.send,
                                              config.server.engine_events_per_s)
        if self.summaries.enabled:
            self.summaries.install()
        self.send(EngineReady(pid=os.getpid(), max_model_len=self.core.max_model_len,
                              num_blocks=self.core.num_blocks,
                              block_size=self.core.kv_cache_manager.block_size,
                              eos_token_id=self.core.eos_token_id,
                              vocab_size=self.core.model_facts.vocab_size,
                              eos_token_ids=list(self.core.model_facts.eos_token_ids)))

    # -- I/O -------------------------------------------------------------------------------
    def send(self, msg: EngineMessage) -> None:
        data = self.encoder.encode(msg)
        while True:
            try:
                self.output.send(data, copy=False)
                return
            except zmq.Again:  # nobody reads: is the parent still there?
                if not self.parent_alive():
                    self.stop = True
                    return

    def parent_alive(self) -> bool:
        if self.parent_pid is None:
            return True
        return os.getppid() == self.parent_pid

    def drain_inputs(self, block: bool) -> None:
        if block and not self.input.poll(IDLE_POLL_MS):
            return
        aborted_outputs: list[EngineCoreOutput] = []
        errors: dict[str, str] = {}
        queries: list[EngineSnapshotQuery] = []
        while not self.stop:
            try:
                data = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = self.decoder.decode(data.buffer)
            except msgspec.DecodeError as e:
                logger.error("engine core: dropped an undecodable message: %s", e)
                continue
            if isinstance(msg, EngineCoreRequest):
                err = self.add_request(msg)
                if err is not None:
                    errors[msg.request_id] = err
                self.summaries.state_changed()
            elif isinstance(msg, AbortRequests):
                outs = self.core.abort_requests(msg.request_ids)
                aborted_outputs.extend(outs)
                self.summaries.state_changed()
            elif isinstance(msg, EngineSnapshotQuery):
                queries.append(msg)
            elif isinstance(msg, ShutdownEngine):
                self.stop = True
            elif isinstance(msg, UtilityCall):
                self.send(self.call_utility(msg))
        if aborted_outputs or errors:
            # Answer at once (not after the next step): the front end learns that the blocks
            # are free even when nothing else runs.
            self.send(EngineCoreOutputs(outputs=aborted_outputs, stats=self.core.stats(),
                                        timings=self.pop_timings(aborted_outputs),
                                        errors=errors))
        for query in queries:  # after the aborts above: the snapshot shows their blocks freed
            self.send(self.summaries.snapshot(query))

    def call_utility(self, msg: UtilityCall) -> UtilityResult:
        method = UTILITY_METHODS.get(msg.method)
        if method is None:
            return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}",
                                 error_type="ValueError")
        try:
            return UtilityResult(msg.call_id, result=method(self.core, *msg.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the engine goes on
            return UtilityResult(msg.call_id, error=str(e), error_type=type(e).__name__)

    def add_request(self, msg: EngineCoreRequest) -> str | None:
        from llmkit.request import Request

        try:
            params = decode_sampling_params(msg.sampling_params)
            lora_id = None
            if msg.lora_request is not None:
                self.core.add_lora(msg.lora_request)
                lora_id = msg.lora_request.lora_int_id
            req = Request(msg.request_id, msg.prompt_token_ids, params,
                          eos_token_id=self.core.eos_token_id, arrival_time=self.core.clock(),
                          priority=msg.priority, cache_salt=msg.cache_salt, lora_id=lora_id,
                          mm_features=msg.mm_features)
            self.core.add_request(req)
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
            return f"{type(e).__name__}: {e}"
        self.requests[msg.request_id] = req
        return None

    def pop_timings(self, outputs: list[EngineCoreOutput]) -> dict[str, RequestTiming]:
        timings = {}
        for out in outputs:
            if out.finish_reason is None:
                continue
            req = self.requests.pop(out.request_id, None)
            if req is None:
                continue
            t = req.times
            queue = None if t.first_scheduled is None else max(t.first_scheduled - t.arrival, 0.0)
            timings[out.request_id] = RequestTiming(queue_time=queue,
                                                    num_preemptions=req.num_preemptions)
        return timings

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while not self.stop:
            idle = not core.has_unfinished_requests()
            if idle:
                self.summaries.flush()  # the state the last steps left, before blocking
            self.drain_inputs(block=idle)
            if self.stop:
                break
            if core.has_unfinished_requests():
                outputs = core.step()
                # Requests the engine could not serve (a grammar that failed to compile) go
                # back as errors: the API process answers them as refused requests.
                errors = {o.request_id: str(o.stop_reason) for o in outputs
                          if o.finish_reason == "error"}
                if errors:
                    outputs = [o for o in outputs if o.finish_reason != "error"]
                    for rid in errors:
                        self.requests.pop(rid, None)
                self.send(EngineCoreOutputs(outputs=outputs, stats=core.stats(),
                                            timings=self.pop_timings(outputs), errors=errors))
            if not self.parent_alive():
                logger.warning("engine core: the API process (pid %s) is gone; exiting",
                               self.parent_pid)
                break

    def close(self) -> None:
        try:
            self.core.shutdown()
        except Exception:  # noqa: BLE001 - closing anyway
            logger.exception("engine core: shutdown of the executor failed")
        finally:
            self.input.close(linger=0)
            self.output.close(linger=1000)
            self.ctx.term()


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run_engine_core(config: dict, input_address: str, output_address: str,
                    parent_pid: int | None = None, log_level: int = logging.INFO, *,
                    engine_index: int | None = None, cpus: list[int] | None = None,
                    env: dict[str, str] | None = None) -> None:
    """Entry point of the engine-core process (``multiprocessing`` spawn target).

    ``config`` is ``EngineConfig.model_dump(mode="json", by_alias=True)``, re-validated here;
    ``model.path`` already names the resolved model (the API process fetched it). One of
    several data-parallel engine cores gets its ``engine_index``, the ``cpus`` it is bound to
    and its environment (``CUDA_VISIBLE_DEVICES``), all applied before torch loads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if env:
        os.environ.update(env)
    if cpus:
        os.sched_setaffinity(0, cpus)  # the executor's workers inherit it
    # The OpenMP wait policy came with the environment (its spawner set it before this
    # process started: llmkit.config.openmp_env); logged so that a run shows it.
    from llmkit.config.openmp_env import WAIT_POLICY_VARS
    omp_env = {k: os.environ[k] for k in WAIT_POLICY_VARS if k in os.environ}
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(levelname)s %(asctime)s [engine-core"
                               f"{'' if engine_index is None else engine_index} "
                               f"pid={os.getpid()}] %(name)s: %(message)s")
    proc = None
    exit_code = 0
    logger.info("engine core process started (parent pid %s)%s", parent_pid,
                f"; OpenMP: {' '.join(f'{k}={v}' for k, v in omp_env.items())}" if omp_env
                else "")
    if cpus:
        logger.info("engine core %s bound to CPUs %s", engine_index, ",".join(map(str, cpus)))
    try:
        from llmkit.config.schema import EngineConfig

        engine_config = EngineConfig.model_validate(config)
        proc = EngineCoreProc(engine_config, input_address, output_address, parent_pid)
        logger.info("engine core ready: %d KV blocks, max_model_len=%d",
                    proc.core.num_blocks, proc.core.max_model_len)
        proc.run()
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        logger.error("engine core failed:\n%s", traceback.format_exc())
        if proc is not None:
            proc.send(EngineFailed(message=f"{type(e).__name__}: {e}"))
        exit_code = 1
    finally:
        try:
            if proc is not None:
                proc.close()
            logger.info("engine core stopped")
        finally:
            # Everything this process owns is closed; skip the interpreter's teardown of
            # torch & co. (seconds on a busy box) so that shutdown is quick.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
