"""Executors decide where workers run: in this process, in several processes, on a cluster,
or nowhere at all (a simulator). The engine core talks to them through this interface only."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from llmkit.config.schema import EngineConfig
from llmkit.facts import BackendInfo, ModelFacts
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput

if TYPE_CHECKING:
    from llmkit.cost_model.step_cost import CostModel
    from llmkit.kv_transfer.base import KVConnectorBase, KVLayout


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
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its output. An executor whose
        ``max_concurrent_batches`` is above 1 also takes ``non_block=True`` and then returns a
        :class:`StepFuture` at once (the step runs while the engine schedules the next)."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once (vLLM's name): the pipeline's stages, so
        that each computes a batch while the others do; 1 = one step at a time."""
        return 1

    def step_cost_model(self) -> CostModel | None:
        """The cost model this executor's steps follow, if it has one (the simulator's:
        ``scheduler=slo`` then predicts steps with the very model that prices them); None =
        real kernels, and the engine builds one from ``scheduler.cost_profile``."""
        return None

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
    def kv_layout(self, fingerprint: str) -> "KVLayout":
        """The KV pool's layout (for KV connectors); before ``initialize_kv_cache``."""
        raise NotImplementedError(f"{type(self).__name__} has no KV connector seam")

    def init_kv_connector(self, cls: "type[KVConnectorBase]", layout: "KVLayout") -> None:
        """Build the worker side of KV connector ``cls`` beside each worker's runner (before
        ``initialize_kv_cache``: a connector may own the pool's memory)."""
        raise NotImplementedError(f"{type(self).__name__} has no KV connector seam")

    def shutdown(self) -> None:
        """Release workers and their memory."""


class StepFuture(ABC):
    """A step in flight (``execute_model(..., non_block=True)``). The engine takes results in
    the order it sent the steps."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """The step's output; blocks until it is there (raises what the step raised)."""


class DoneFuture(StepFuture):
    """A step whose output is known already (nothing ran, or it ran synchronously)."""

    __slots__ = ("output",)

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output
