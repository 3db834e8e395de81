"""What an executor with several worker ranks (multiproc, Ray) knows of them after start-up:
each rank's :class:`WorkerReady` report, and the executor-interface answers drawn from them."""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.executor.worker_proc import WorkerReady


def output_rank(config: EngineConfig) -> int:
    """The rank whose output is the step's result: the first of the last pipeline stage."""
    return config.parallel.world_size - config.parallel.tensor_parallel_size


class RankedExecutor(Executor):
    """The executor interface over ranks' start-up reports: the output rank's model facts and
    backend, the KV block cost summed over the ranks, one step in flight per stage. A
    subclass starts its ranks and then calls :meth:`_take_reports`."""

    _reports: list[WorkerReady]

    def _take_reports(self, reports: list[WorkerReady]) -> None:
        self._reports = reports

    @property
    def model_facts(self) -> ModelFacts:
        return self._reports[output_rank(self.config)].model_facts

    @property
    def backend_info(self) -> BackendInfo:
        return self._reports[output_rank(self.config)].backend_info

    def kv_cache_bytes_per_block(self) -> int:
        # Every rank holds its own KV heads of its own layers for every block: a block costs
        # the sum.
        return sum(r.kv_cache_bytes_per_block for r in self._reports)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size
