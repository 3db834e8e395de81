"""The worker-process side of ``executor=multiproc`` (vLLM's WorkerProc): one process per rank
runs a :class:`Worker` and reads every step from the shared-memory ring.

Messages on the ring start with an opcode byte: ``E`` a step (``SchedulerOutput`` as msgpack),
``K`` allocate the KV cache (8-byte block count), ``L`` add a LoRA adapter (a pickled
``LoRARequest``), ``D`` remove one (its id, 8 bytes), ``S`` stop. Replies go back on the
rank's own pipe, first byte a tag: ``R`` ready (pickled facts, once), ``O`` the output rank's
step output (msgpack; the output rank is the first of the last pipeline stage), ``k`` KV cache
allocated, ``l`` a LoRA call's result (pickled ``(ok, value)``: the return value, or the
message of the ``ValueError`` that refused the adapter; the worker serves on), ``X`` an error
(the worker exits after it).
"""
from __future__ import annotations

import logging
import os
import pickle
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any

OP_EXECUTE, OP_INIT_KV, OP_SHUTDOWN = b"E", b"K", b"S"
OP_ADD_LORA, OP_REMOVE_LORA = b"L", b"D"
TAG_READY, TAG_OUTPUT, TAG_KV_READY, TAG_ERROR = b"R", b"O", b"k", b"X"
TAG_LORA = b"l"
_BLOCKS = struct.Struct("<q")


def encode_init_kv(num_blocks: int) -> bytes:
    return OP_INIT_KV + _BLOCKS.pack(num_blocks)


def encode_remove_lora(lora_id: int) -> bytes:
    return OP_REMOVE_LORA + _BLOCKS.pack(lora_id)


def _lora_call(call) -> bytes:
    """Run a worker's LoRA call; a refused adapter (``LoRALoadError``, a ``ValueError``) is
    the reply, not the end of the worker."""
    try:
        return TAG_LORA + pickle.dumps((True, call()))
    except ValueError as e:
        return TAG_LORA + pickle.dumps((False, str(e)))


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """What a worker reports once its shard is loaded."""

    kv_cache_bytes_per_block: int
    model_facts: Any
    backend_info: Any
    cpus: tuple[int, ...] = ()  # the rank's CPU affinity


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process starts from (pickled once, at spawn)."""

    rank: int
    world_size: int
    config: dict  # EngineConfig.model_dump(mode="json", by_alias=True)
    init_method: str  # torch.distributed's rendezvous
    backend: str  # gloo / nccl
    num_threads: int
    parent_pid: int
    log_level: int
    # the CPUs this rank is bound to (parallel.cpu_binding); None = unbound
    cpus: tuple[int, ...] | None = None


def run_worker(spec: WorkerSpec, ring_handle, conn) -> None:
    """A worker process's main: build the rank's shard, then serve the ring until told to
    stop, the parent dies, or a step fails (the error goes to the parent, then exit 1)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s rank{spec.rank} "
                        "%(levelname)s %(name)s: %(message)s")
    try:
        _serve(spec, ring_handle, conn)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - everything is reported, then the process ends
        message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            conn.send_bytes(TAG_ERROR + message.encode("utf-8", "replace"))
        except OSError:
            pass
        sys.exit(1)


def build_worker(spec: WorkerSpec):
    """Join the process group and load the rank's shard (multiproc's and Ray's workers)."""
    import torch

    from llmkit.config.schema import EngineConfig
    from llmkit.distributed.group import initialize_model_parallel
    from llmkit.platforms import resolve_platform
    from llmkit.worker.worker import Worker

    config = EngineConfig.model_validate(spec.config)
    platform = resolve_platform(config.platform)
    platform.apply_runtime_settings()
    if spec.cpus is not None:  # its threads, started below, inherit the affinity
        os.sched_setaffinity(0, spec.cpus)
    torch.set_num_threads(spec.num_threads)  # this rank's share of the cores
    torch.distributed.init_process_group(spec.backend, init_method=spec.init_method,
                                         rank=spec.rank, world_size=spec.world_size)
    tp, pp = initialize_model_parallel(spec.rank, config.parallel.tensor_parallel_size,
                                       config.parallel.pipeline_parallel_size)
    return Worker(config, platform, tp=tp, pp=pp)


def _serve(spec: WorkerSpec, ring_handle, conn) -> None:
    from llmkit.distributed.shm_broadcast import ShmRingBuffer
    from llmkit.executor.step_codec import StepDecoder, StepEncoder

    worker = build_worker(spec)
    ring = ShmRingBuffer.attach(ring_handle, spec.rank)
    conn.send_bytes(TAG_READY + pickle.dumps(WorkerReady(
        worker.kv_cache_bytes_per_block(), worker.model_facts, worker.backend_info,
        tuple(sorted(os.sched_getaffinity(0))))))
    decoder, encoder = StepDecoder(), StepEncoder()
    output_rank = worker.is_output_rank

    def check_parent() -> None:
        if os.getppid() != spec.parent_pid:
            raise SystemExit(0)  # the engine is gone: nothing will read our results

    try:
        while True:
            msg = ring.dequeue(on_idle=check_parent)
            op = msg[:1]
            if op == OP_EXECUTE:
                out = worker.execute_model(decoder.decode(memoryview(msg)[1:]))
                if output_rank:
                    conn.send_bytes(TAG_OUTPUT + encoder.encode_output(out))
            elif op == OP_INIT_KV:
                worker.initialize_kv_cache(_BLOCKS.unpack_from(msg, 1)[0])
                conn.send_bytes(TAG_KV_READY)
            elif op == OP_ADD_LORA:
                request = pickle.loads(memoryview(msg)[1:])
                conn.send_bytes(_lora_call(lambda: worker.add_lora(request)))
            elif op == OP_REMOVE_LORA:
                lora_id = _BLOCKS.unpack_from(msg, 1)[0]
                conn.send_bytes(_lora_call(lambda: worker.remove_lora(lora_id)))
            elif op == OP_SHUTDOWN:
                break
            else:
                raise RuntimeError(f"unknown message {op!r} on the executor's ring")
    finally:
        worker.shutdown()
        ring.close()
    # Told to stop: leave at once. The interpreter's teardown (torch's, gloo's) takes seconds
    # on a busy machine and has nothing left to save; a failure above still reports first.
    os._exit(0)
