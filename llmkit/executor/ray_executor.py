"""``executor=ray``: the same workers as Ray actors, one per rank, in a placement group, on an
existing cluster (``executor.ray_address``) or a local one started here (vLLM's
RayDistributedExecutor, without compiled graphs).

Each step's ``SchedulerOutput`` is encoded once and put into Ray's object store once; every
actor receives the same object reference (Ray's broadcast, not a pickle per worker). The output
rank's reply (rank 0; the first rank of the last stage under pipeline parallel) is the step's
output; with ``pipeline_parallel_size`` stages up to that many steps are in flight (an actor
runs its calls in the order they were made). An actor that dies fails the step with Ray's error at once (the
executor waits on every rank's reply, so a dead rank never leaves it waiting on rank 0).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from llmkit.config.openmp_env import wait_policy_env
from llmkit.config.schema import EngineConfig
from llmkit.executor.base import StepFuture
from llmkit.executor.multiproc import WorkerDiedError, threads_per_rank
from llmkit.executor.parallel_checks import check_parallel_config, distributed_backend
from llmkit.executor.rank_reports import RankedExecutor, output_rank
from llmkit.executor.step_codec import StepDecoder, StepEncoder
from llmkit.executor.worker_proc import WorkerReady, WorkerSpec, build_worker
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput

logger = logging.getLogger(__name__)


class RayWorker:
    """One rank inside a Ray actor."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = 0
        self._decoder, self._encoder = StepDecoder(), StepEncoder()

    def address(self) -> str:
        """``tcp://ip:port`` for the process group's rendezvous (asked of rank 0)."""
        import ray

        from llmkit.executor.multiproc import free_port
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, spec: WorkerSpec) -> WorkerReady:
        self.rank = spec.rank
        self.worker = build_worker(spec)
        w = self.worker
        return WorkerReady(w.kv_cache_bytes_per_block(), w.model_facts, w.backend_info)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, step: bytes) -> bytes | None:
        out = self.worker.execute_model(self._decoder.decode(step))
        return self._encoder.encode_output(out) if self.worker.is_output_rank else None


class RayExecutor(RankedExecutor):
    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config, platform)
        source = model_source or resolve_model_source(config.model)
        check_parallel_config(config, source.hf_config, platform)
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.world_size = world = config.parallel.world_size
        self._failed: str | None = None
        self._encoder, self._decoder = StepEncoder(), StepDecoder()
        self._started_ray = False
        self.actors: list[Any] = []
        self._pg = None
        address = config.executor.ray_address
        threads = threads_per_rank(config, world)
        if not ray.is_initialized():
            if address is None:  # a local cluster, ours to stop
                ray.init(num_cpus=max(world, len(os.sched_getaffinity(0))),
                         include_dashboard=False, log_to_driver=True,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
                self._started_ray = True
            else:
                ray.init(address=address)
        device = "GPU" if platform.device.type == "cuda" else "CPU"
        try:
            self._pg = placement_group([{device: 1}] * world, strategy="PACK")
            ray.get(self._pg.ready(), timeout=120)
            actor_cls = ray.remote(RayWorker)
            # An actor's process imports torch with the actor's class: its OpenMP wait policy
            # goes in the environment Ray starts it with (merged into the job's env_vars),
            # on a local cluster or a remote one.
            omp_env = wait_policy_env(device == "CPU")
            self.actors = [
                actor_cls.options(
                    num_cpus=1 if device == "CPU" else 0, num_gpus=1 if device == "GPU" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=rank),
                    **({"runtime_env": {"env_vars": omp_env}} if omp_env else {})).remote()
                for rank in range(world)]
            init_method = ray.get(self.actors[0].address.remote())
            payload = config.model_dump(mode="json", by_alias=True)
            backend = distributed_backend(config, platform)
            ready = self._get([a.start.remote(WorkerSpec(
                rank, world, payload, init_method, backend, threads, os.getpid(),
                logging.getLogger("llmkit").getEffectiveLevel()))
                for rank, a in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise
        self._output_rank = output_rank(config)
        self._take_reports(ready)
        logger.info("ray executor: %d actors (%s each), cluster %s", world, device,
                    address or "local")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._get([a.initialize_kv_cache.remote(num_blocks) for a in self.actors])

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | StepFuture:
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        step = self._ray.put(self._encoder.encode(scheduler_output))  # once, for every actor
        future = _RayStepFuture(self, [a.execute_model.remote(step) for a in self.actors])
        return future if non_block else future.result()

    def _output(self, refs: list) -> ModelRunnerOutput:
        return self._decoder.decode_output(self._get(refs)[self._output_rank])

    def _get(self, refs: list) -> list:
        """Every rank's result; the first failure (a dead actor, a raised step) raises at
        once rather than after the other ranks, which may wait for it forever."""
        ray = self._ray
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError, ...
                    rank = refs.index(ref)
                    self._failed = f"ray worker rank {rank} failed: {type(e).__name__}: {e}"
                    logger.error("%s", self._failed)
                    raise WorkerDiedError(self._failed) from None
        return ray.get(refs)

    def shutdown(self) -> None:
        ray = self._ray
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._pg is not None:
            try:
                self._remove_pg(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


class _RayStepFuture(StepFuture):
    __slots__ = ("_executor", "_refs")

    def __init__(self, executor: RayExecutor, refs: list) -> None:
        self._executor = executor
        self._refs = refs

    def result(self) -> ModelRunnerOutput:
        return self._executor._output(self._refs)
