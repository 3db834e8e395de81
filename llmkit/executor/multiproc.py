"""``executor=multiproc``: one spawned worker process per rank on this machine (vLLM's
MultiprocExecutor).

Workers start from any program -- a script without an ``if __name__ == "__main__":`` guard,
code on standard input, a notebook -- because the spawned children do not re-run the user's
``__main__`` (``worker_launch.py``); their stderr is teed, and its last lines end every
``WorkerDiedError``.

Each step's ``SchedulerOutput`` is encoded once and written to a shared-memory ring that every
worker reads (``llmkit.distributed.shm_broadcast``); only the output rank (rank 0, or under
pipeline parallel the first rank of the last stage) sends the step's result back. With
``pipeline_parallel_size`` stages, up to that many steps are in flight (``non_block=True``
returns a :class:`StepFuture`; the results come back in step order). The executor waits on the workers' pipes *and* their process sentinels, so
a worker that dies (killed, out of memory, a failed step) fails the engine at once with its
rank and exit code, never a hang.

On the CPU each rank gets its share of the cores as torch threads
(``platform.num_threads`` or the usable cores, divided by the ranks).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

from llmkit.config.openmp_env import openmp_env_for_children
from llmkit.config.schema import EngineConfig
from llmkit.distributed.shm_broadcast import ShmRingBuffer
from llmkit.executor.base import StepFuture
from llmkit.executor.parallel_checks import check_parallel_config, distributed_backend
from llmkit.executor.rank_reports import RankedExecutor, output_rank
from llmkit.executor.step_codec import StepDecoder, StepEncoder
from llmkit.executor.worker_launch import StderrTail, start_process
from llmkit.executor.worker_proc import (OP_ADD_LORA, OP_EXECUTE, OP_SHUTDOWN, TAG_ERROR,
                                         TAG_KV_READY, TAG_LORA, TAG_OUTPUT, TAG_READY,
                                         WorkerSpec, encode_init_kv, encode_remove_lora,
                                         run_worker)
from llmkit.lora.request import LoRALoadError, LoRARequest
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process ended or failed; the engine cannot go on."""


@dataclass(slots=True)
class _WorkerHandle:
    rank: int
    proc: Any  # multiprocessing.Process
    conn: Any  # the parent's end of the rank's pipe
    stderr: StderrTail | None = None  # the last lines the worker wrote to stderr
    inbox: deque = field(default_factory=deque)  # replies read before they were asked for


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(config: EngineConfig, world_size: int) -> int:
    cores = config.platform.num_threads or len(os.sched_getaffinity(0))
    return max(1, cores // world_size)


def cpu_slices(cpus: list[int], world_size: int) -> list[tuple[int, ...] | None]:
    """Each rank's own contiguous slice of ``cpus`` (the remainder to no one), or no binding
    for any rank when there are fewer CPUs than ranks (binding would pin two to one core)."""
    per = len(cpus) // world_size
    if per == 0:
        return [None] * world_size
    return [tuple(cpus[r * per:(r + 1) * per]) for r in range(world_size)]


class MultiprocExecutor(RankedExecutor):
    # every rank holds its slice of each adapter, cut like its base layers (pipeline stages
    # are refused by check_pipeline_parallel)
    supports_lora = True

    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        super().__init__(config, platform)
        source = model_source or resolve_model_source(config.model)
        check_parallel_config(config, source.hf_config, platform)
        self.world_size = config.parallel.world_size
        self.output_rank = output_rank(config)
        # steps sent and results taken, counted from 0 (results come back in order)
        self._num_sent = self._num_received = 0
        self._results: dict[int, ModelRunnerOutput] = {}
        self._failed: str | None = None
        self.workers: list[_WorkerHandle] = []
        self.ring: ShmRingBuffer | None = None
        self._encoder, self._decoder = StepEncoder(), StepDecoder()
        spawn = multiprocessing.get_context("spawn")
        self.ring = ShmRingBuffer.create(self.world_size, spawn.Semaphore)
        # An owner that never calls shutdown (a CLI run) still stops the workers and frees the
        # ring at exit, before multiprocessing's own hook would wait on the workers.
        atexit.register(self.shutdown)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = threads_per_rank(config, self.world_size)
        bind = config.parallel.cpu_binding == "auto" and platform.device.type == "cpu"
        slices = (cpu_slices(sorted(os.sched_getaffinity(0)), self.world_size) if bind
                  else [None] * self.world_size)
        logger.info("multiproc executor: %d worker processes, %d threads each, %s, %s",
                    self.world_size, threads, distributed_backend(config, platform),
                    "bound to CPUs " + " | ".join(",".join(map(str, c)) for c in slices)
                    if slices[0] is not None else "unbound")
        payload = config.model_dump(mode="json", by_alias=True)
        # A worker loads torch before run_worker runs (unpickling its target imports
        # llmkit.executor), so its OpenMP wait policy must be in the environment it starts with.
        try:
            with openmp_env_for_children(platform.device.type == "cpu"):
                for rank in range(self.world_size):
                    parent_end, child_end = spawn.Pipe(duplex=False)
                    spec = WorkerSpec(rank, self.world_size, payload, init_method,
                                      distributed_backend(config, platform), threads,
                                      os.getpid(), logging.getLogger("llmkit").getEffectiveLevel(),
                                      cpus=slices[rank])
                    proc, tail = start_process(spawn, run_worker,
                                               (spec, self.ring.handle, child_end),
                                               f"llmkit-worker-{rank}")
                    child_end.close()
                    self.workers.append(_WorkerHandle(rank, proc, parent_end, stderr=tail))
            ready = [pickle.loads(self._recv(w, TAG_READY)[1:]) for w in self.workers]
        except BaseException:
            self.shutdown()
            raise
        logger.info("multiproc executor: worker pids %s",
                    " ".join(f"rank{w.rank}={w.proc.pid}" for w in self.workers))
        self._take_reports(ready)
        #: The CPUs each rank runs on (its affinity as it reported it).
        self.worker_cpus: list[tuple[int, ...]] = [r.cpus for r in ready]

    # -- the executor interface ------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(encode_init_kv(num_blocks))
        for w in self.workers:
            self._recv(w, TAG_KV_READY)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._lora_call(OP_ADD_LORA + pickle.dumps(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_call(encode_remove_lora(lora_id))

    def _lora_call(self, message: bytes):
        """Every rank runs the call; the first refusal raises ``LoRALoadError`` (the ranks
        check the same files, so they agree)."""
        self._broadcast(message)
        replies = [pickle.loads(self._recv(w, TAG_LORA)[1:]) for w in self.workers]
        for ok, value in replies:
            if not ok:
                raise LoRALoadError(value)
        return replies[0][1]

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | StepFuture:
        self._broadcast(OP_EXECUTE + self._encoder.encode(scheduler_output))
        seq = self._num_sent
        self._num_sent += 1
        future = _MultiprocStepFuture(self, seq)
        return future if non_block else future.result()

    def _result(self, seq: int) -> ModelRunnerOutput:
        """Step ``seq``'s output: the output rank's replies are read in order until it is in."""
        while self._num_received <= seq:
            data = self._recv(self.workers[self.output_rank], TAG_OUTPUT)
            self._results[self._num_received] = self._decoder.decode_output(
                memoryview(data)[1:])
            self._num_received += 1
        return self._results.pop(seq)

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        workers, self.workers = getattr(self, "workers", []), []
        if workers and self._failed is None:
            try:
                self.ring.enqueue(OP_SHUTDOWN, check_alive=lambda: self._check_alive(workers))
            except WorkerDiedError:
                pass
        # A failed engine does not wait: the other ranks may sit in a collective forever.
        deadline = time.monotonic() + (5.0 if self._failed is None else 0.0)
        for w in workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=2.0)
            w.conn.close()
        ring = getattr(self, "ring", None)
        if ring is not None:
            ring.close()
            self.ring = None

    # -- plumbing --------------------------------------------------------------------------
    def _broadcast(self, message: bytes) -> None:
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        self.ring.enqueue(message, check_alive=lambda: self._check_alive(self.workers))

    def _check_alive(self, workers: list[_WorkerHandle]) -> None:
        for w in workers:
            if not w.proc.is_alive():
                self._fail(w, None)

    def _recv(self, target: _WorkerHandle, tag: bytes) -> bytes:
        """The next reply of ``target`` (it must start with ``tag``); raises as soon as any
        worker reports an error or its process ends. Other ranks' replies that arrive
        meanwhile wait in their inbox."""
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        by_conn = {w.conn: w for w in self.workers}
        by_sentinel = {w.proc.sentinel: w for w in self.workers}
        while not target.inbox:
            ready = connection.wait([*by_conn, *by_sentinel])
            for obj in ready:  # replies first: an error report says why, a sentinel does not
                w = by_conn.get(obj)
                if w is None:
                    continue
                try:
                    data = obj.recv_bytes()
                except (EOFError, OSError):
                    self._fail(w, None)
                if data[:1] == TAG_ERROR:
                    self._fail(w, data[1:].decode("utf-8", "replace"))
                w.inbox.append(data)
            for obj in ready:
                if obj in by_sentinel:
                    self._fail(by_sentinel[obj], None)
        data = target.inbox.popleft()
        if data[:1] != tag:
            self._fail(target, f"unexpected reply {data[:1]!r} (wanted {tag!r})")
        return data

    def _fail(self, w: _WorkerHandle, message: str | None) -> None:
        w.proc.join(timeout=0.5)
        code = w.proc.exitcode
        why = message or (f"the process ended with exit code {code}" if code is not None
                          else "its pipe closed")
        self._failed = f"worker rank {w.rank} (pid {w.proc.pid}) failed: {why}"
        # What the worker printed says why when no report could be sent (it died while
        # starting, was killed, or crashed in native code).
        tail = w.stderr.text(wait_s=1.0 if code is not None else 0.2) if w.stderr else ""
        if tail:
            self._failed += f"\n--- last lines of rank {w.rank}'s stderr ---\n{tail}"
        logger.error("%s", self._failed)
        raise WorkerDiedError(self._failed)


class _MultiprocStepFuture(StepFuture):
    __slots__ = ("_executor", "_seq")

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self._seq = seq

    def result(self) -> ModelRunnerOutput:
        return self._executor._result(self._seq)
