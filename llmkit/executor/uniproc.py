"""One worker in the engine-core process: the default on a single device."""
from __future__ import annotations

import logging

import torch

from llmkit.attention import attention_backend_class
from llmkit.config.schema import EngineConfig
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.kv_transfer.base import KVConnectorBase, KVConnectorRole, KVLayout
from llmkit.config.errors import ConfigError
from llmkit.executor.parallel_checks import check_expert_parallel
from llmkit.lora.base import LoRARequest
from llmkit.lora.manager import LoRAManager, LoRASetup
from llmkit.models.base import ModelContext
from llmkit.models.interfaces import supports_multimodal
from llmkit.models.loader import ModelSource, build_model, resolve_model_source, text_config
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.sampling import SAMPLERS
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode import ProposerEnv, build_proposer
from llmkit.worker.model_runner import ModelRunner
from llmkit.worker.spec_setup import adaptive_length_policy
from llmkit.worker.model_setup import (describe_backend, linear_method_factory, resolve_dtype,
                                       resolve_kv_cache_dtype)

logger = logging.getLogger(__name__)

def check_encoder_budget(model: torch.nn.Module, config: EngineConfig) -> None:
    """An image must fit the encoder cache and one step's encoder budget, or it could never
    be encoded: a multimodal model with a smaller setting fails at start-up."""
    n = getattr(model, "num_image_tokens", None)
    if not supports_multimodal(model) or n is None:
        return
    s = config.scheduler
    for key, value in (("scheduler.encoder_cache_size", s.encoder_cache_size),
                       ("scheduler.max_num_encoder_input_tokens",
                        s.max_num_encoder_input_tokens)):
        if value < n:
            raise ConfigError(key, value, f"an integer >= {n} (this model's tokens per image)")


class UniprocExecutor(Executor):
    supports_lora = True

    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None) -> None:
        super().__init__(config, platform)
        source = model_source or resolve_model_source(config.model)
        check_expert_parallel(config, source.hf_config)
        dtype = resolve_dtype(config.model.dtype, platform)
        ops = platform.ops(dtype)
        attn = attention_backend_class(config.attention, platform)(ops)
        quantization = source.quantization
        linear_method, quantization = linear_method_factory(config.model, platform, dtype,
                                                            quantization)
        lora = None
        if config.lora.enabled:
            lora = LoRASetup(config.lora, source, platform, dtype,
                             max_num_tokens=config.scheduler.max_num_batched_tokens)
            linear_method = lora.wrap(linear_method)
        ctx = ModelContext(attn_backend=attn, dtype=dtype, ops=ops, linear_method=linear_method,
                           quantization=quantization)
        torch.manual_seed(config.seed)
        model = build_model(source, ctx, platform.device)
        check_encoder_budget(model, config)
        sampler = SAMPLERS.resolve(config.sampler.name, config.sampler.target)(seed=config.seed)
        self._facts = ModelFacts(
            max_model_len=source.max_model_len,
            vocab_size=text_config(source.hf_config).vocab_size,
            eos_token_id=source.eos_token_ids[0] if source.eos_token_ids else None,
            eos_token_ids=tuple(source.eos_token_ids),
        )
        self._dtype = dtype
        self._names = (attn.name, ops.name)
        self.runner = ModelRunner(
            model, attn, sampler,
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=source.max_model_len,
            block_size=config.kv_cache.block_size,
            num_lookahead_tokens=config.scheduler.num_lookahead_tokens,
            kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache.cache_dtype, dtype),
            device=platform.device,
        )
        self.runner.proposer = build_proposer(config.speculative, ProposerEnv(
            target=model, ctx=ctx, device=platform.device, max_model_len=source.max_model_len,
            block_size=config.kv_cache.block_size, seed=config.seed))
        self.runner.make_step_graphs = lambda model, kv_caches: platform.step_graphs(
            model, kv_caches, config.compilation, config.scheduler.max_num_seqs)
        if lora is not None:
            self.runner.lora_manager = lora.manager(model)
            if config.compilation.mode == "graphs" and not lora.ops.supports_step_graphs:
                # Said once at start: the fast path is lost for those steps, not silently.
                logger.warning("LoRA: the %s LoRA ops cannot run inside step graphs; decode "
                               "steps where a row uses an adapter run eagerly (steps without "
                               "adapters still use the graphs)", lora.ops.name)

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def backend_info(self) -> BackendInfo:
        return describe_backend(self.runner, *self._names, self._dtype, self.platform)

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        proposer = self.runner.proposer
        spec = self.config.speculative
        if proposer is not None and (spec.adaptive or spec.disable_by_batch_size):
            proposer.length_policy = adaptive_length_policy(
                spec, self.platform, self.runner, self.config.scheduler.max_num_seqs)

    def kv_layout(self, fingerprint: str) -> KVLayout:
        return self.runner.kv_layout(fingerprint)

    def init_kv_connector(self, cls: type[KVConnectorBase], layout: KVLayout) -> None:
        self.runner.kv_connector = cls(self.config, KVConnectorRole.WORKER, layout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_adapter(lora_id)

    def _lora_manager(self) -> LoRAManager:
        manager = self.runner.lora_manager
        if manager is None:
            raise ValueError("LoRA adapters need lora.enabled=true")
        return manager

    def shutdown(self) -> None:
        self.runner.kv_caches.clear()
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
