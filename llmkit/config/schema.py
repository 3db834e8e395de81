"""The engine config (``EngineConfig``): one section per component kind, each defined in
``llmkit.config.sections`` (the platform's in ``platform_schema``) and importable from here.

``conf/config.yaml`` composes to an ``EngineConfig``: the engine's sections only. The tools'
root (``conf/tools/tools.yaml``) composes that file and adds the tools' sections beside it
(``llmkit/tools/schema.py``); the engine never sees them.

Every model forbids unknown keys, so a typo fails at start-up with the dotted key. Implementation
names are checked against the component's registry by the composer (`compose.py`), which knows
the registries; this package stays below every component.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from llmkit.config.platform_schema import CpuDispatchConfig, PlatformConfig
from llmkit.config.sections.execution import (AttentionConfig, CompilationConfig,
                                              ExecutorConfig, ParallelConfig, SamplerConfig,
                                              StructuredOutputConfig)
from llmkit.config.sections.kv_cache import KVCacheConfig, KVOffloadConfig, KVTransferConfig
from llmkit.config.sections.lora import LoRAConfig
from llmkit.config.sections.model import GenerationDefaults, ModelConfig
from llmkit.config.sections.scheduling import SchedulerConfig, SloConfig, check_slo_scheduler
from llmkit.config.sections.serving import (ChatConfig, MultiModalConfig, ObservabilityConfig,
                                            SamplingDefaults, ServerConfig)
from llmkit.config.sections.speculative import SpeculativeConfig
from llmkit.config.sections.strict import _Strict

__all__ = [
    "AttentionConfig", "ChatConfig", "CompilationConfig", "CpuDispatchConfig", "EngineConfig",
    "ExecutorConfig", "GenerationDefaults", "KVCacheConfig", "KVOffloadConfig",
    "KVTransferConfig", "LoRAConfig", "ModelConfig", "MultiModalConfig", "ObservabilityConfig",
    "ParallelConfig", "PlatformConfig", "SamplerConfig", "SamplingDefaults", "SchedulerConfig",
    "ServerConfig", "SloConfig", "SpeculativeConfig", "StructuredOutputConfig",
]


class EngineConfig(_Strict):
    model: ModelConfig
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    kv_offload: KVOffloadConfig = Field(default_factory=KVOffloadConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    platform: PlatformConfig = Field(default_factory=PlatformConfig)
    compilation: CompilationConfig = Field(default_factory=CompilationConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    multimodal: MultiModalConfig = Field(default_factory=MultiModalConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    # the service-level objectives: scheduler=slo serves to them, bench serve / sim count
    # goodput by them
    slo: SloConfig = Field(default_factory=SloConfig)
    seed: int = 0
    # The recipe that was applied, if any (informational).
    recipe: str | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> "EngineConfig":
        s = self.scheduler
        if not s.enable_chunked_prefill and self.model.max_model_len is not None \
                and s.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({s.max_num_batched_tokens}) must be >= "
                f"model.max_model_len ({self.model.max_model_len}) when "
                "scheduler.enable_chunked_prefill is false, or long prompts could never run")
        check_slo_scheduler(s, self.slo)
        spec = self.speculative
        if spec.runs_a_model and s.num_lookahead_tokens < spec.num_speculative_tokens:
            # A draft model writes its KV at up to K positions past the verified ones (vLLM
            # sets num_lookahead_slots the same way).
            s.num_lookahead_tokens = spec.num_speculative_tokens
        return self
