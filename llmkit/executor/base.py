"""Executors decide where workers run: in this process, in several processes, on a cluster,
or nowhere at all (a simulator). The engine core talks to them through this interface only."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from llmkit.config.schema import EngineConfig
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.scheduler.base import SchedulerOutput


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What the core (and the front ends' input checks) need to know about the model served."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    # Every end-of-sequence id of the model: the first is ``eos_token_id``; the others (e.g. a
    # chat model's end-of-turn) act as stop tokens (vLLM's rule).
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class BackendInfo:
    """How an executor computes, in words: for logs, benchmark results and tools (nothing
    decides by it)."""

    attention: str  # the attention backend's name (cpu, torch, triton, ...)
    ops: str  # the platform ops' name (norm, rotary, activation, KV write)
    # The distinct ``LinearMethod.describe()`` texts of the model's linear layers.
    linear_methods: tuple[str, ...]
    dtype: str  # the compute dtype (float32, bfloat16, ...)
    device: str
    # Step graphs (compilation.mode=graphs): their name and the most rows a graph covers;
    # None when decode steps run eagerly.
    step_graphs: str | None = None
    step_graphs_max_rows: int = 0


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

    def shutdown(self) -> None:
        """Release workers and their memory."""
