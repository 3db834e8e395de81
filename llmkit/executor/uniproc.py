"""One worker in the engine-core process: the default on a single device."""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.models.loader import ModelSource
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.model_runner import ModelRunner
from llmkit.worker.worker import Worker, linear_method_factory, resolve_dtype

__all__ = ["UniprocExecutor", "linear_method_factory", "resolve_dtype"]


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        super().__init__(config, platform)
        self.worker = Worker(config, platform, model_source)

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    @property
    def model_facts(self) -> ModelFacts:
        return self.worker.model_facts

    @property
    def backend_info(self) -> BackendInfo:
        return self.worker.backend_info

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
