"""One worker in the engine-core process: the default on a single device. It holds one
:class:`~llmkit.worker.worker.Worker` (tensor-parallel and pipeline groups of size 1: the
same worker the multiproc and Ray executors run per rank) and forwards to it."""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.executor.parallel_checks import check_expert_parallel
from llmkit.kv_transfer.base import KVConnectorBase, KVLayout
from llmkit.lora.base import LoRARequest
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.model_runner import ModelRunner
from llmkit.worker.worker import Worker


class UniprocExecutor(Executor):
    supports_lora = True

    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        super().__init__(config, platform)
        source = model_source or resolve_model_source(config.model)
        check_expert_parallel(config, source.hf_config)
        self.worker = Worker(config, platform, source)

    @property
    def runner(self) -> ModelRunner:
        """The worker's runner (tests and benchmarks look inside)."""
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

    def kv_layout(self, fingerprint: str) -> KVLayout:
        return self.worker.kv_layout(fingerprint)

    def init_kv_connector(self, cls: type[KVConnectorBase], layout: KVLayout) -> None:
        self.worker.init_kv_connector(cls, layout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.worker.remove_lora(lora_id)

    def shutdown(self) -> None:
        self.worker.shutdown()
