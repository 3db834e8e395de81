"""One worker in the engine-core process: the default on a single device.

An executor only decides where ranks run. Here the one rank runs in this process, so the
executor is that rank: a :class:`~llmkit.worker.worker.Worker` with tensor-parallel and
pipeline groups of size 1 (the class the multiproc and Ray executors run per rank), and the
engine reaches the rank's runner with no layer that only forwards in between.
"""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.executor.base import Executor
from llmkit.executor.parallel_checks import check_expert_parallel
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.platforms.base import Platform
from llmkit.worker.worker import Worker


class UniprocExecutor(Worker, Executor):
    supports_lora = True

    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        source = model_source or resolve_model_source(config.model)
        check_expert_parallel(config, source.hf_config)
        Worker.__init__(self, config, platform, source)
        # One rank, no pipeline stage to hand on to: a step goes straight to the runner
        # (``Worker.execute_model`` adds nothing at pipeline size 1).
        self.execute_model = self.runner.execute_model
