"""Executors decide where workers run: in this process, in several processes, on a cluster,
or nowhere at all (a simulator). The engine core talks to them through this interface only."""
from __future__ import annotations

from abc import ABC, abstractmethod

from llmkit.config.schema import EngineConfig
from llmkit.facts import BackendInfo, ModelFacts
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform

    @property
    @abstractmethod
    def model_facts(self) -> ModelFacts: ...

    @property
    @abstractmethod
    def backend_info(self) -> BackendInfo:
        """What computes the steps (after ``initialize_kv_cache``, which builds step graphs)."""

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block costs across all layers (and all workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    #: Whether this executor serves LoRA adapters (``add_lora`` / ``remove_lora``); the
    #: engine refuses ``lora.enabled`` at start-up otherwise.
    supports_lora: bool = False

    def add_lora(self, lora_request) -> None:
        """Register and load an adapter (a ``LoRARequest``) in every worker; raises
        ``LoRALoadError`` (a ``ValueError``) when it cannot be served."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (no request in flight uses it); False if it was not known."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def shutdown(self) -> None:
        """Release workers and their memory."""
