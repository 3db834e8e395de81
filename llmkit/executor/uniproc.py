"""One worker in the engine-core process: the default on a single device."""
from __future__ import annotations

import torch

from llmkit.attention import attention_backend_class
from llmkit.config.schema import EngineConfig
from llmkit.executor.base import Executor, ModelFacts
from llmkit.models.loader import ModelSource, build_model, resolve_model_source
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.sampling import SAMPLERS
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    return platform.preferred_dtype() if name == "auto" else _DTYPES[name]


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        super().__init__(config, platform)
        source = model_source or resolve_model_source(config.model)
        dtype = resolve_dtype(config.model.dtype, platform)
        attn_cls = attention_backend_class(config.attention, platform)
        attn = attn_cls()
        torch.manual_seed(config.seed)
        model = build_model(source, attn, dtype, platform.device)
        packing = platform.linear_weight_packing(dtype)
        if packing is not None:
            model.pack_linear_weights(compute_in_float32=packing == "packed_float32")
        kernels = platform.native_kernels(dtype)
        if kernels is not None:
            model.use_native_kernels(kernels)
            attn.use_native_kernels(kernels)
        sampler = SAMPLERS.resolve(config.sampler.name, config.sampler.target)(seed=config.seed)
        self._facts = ModelFacts(
            max_model_len=source.max_model_len,
            vocab_size=source.hf_config.vocab_size,
            eos_token_id=source.eos_token_ids[0] if source.eos_token_ids else None,
        )
        self.runner = ModelRunner(
            model, attn, sampler,
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=source.max_model_len,
            block_size=config.kv_cache.block_size,
            num_lookahead_tokens=config.scheduler.num_lookahead_tokens,
            kv_cache_dtype=dtype,
            device=platform.device,
        )

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner.kv_caches.clear()
