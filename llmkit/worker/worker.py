"""Worker: one rank's model shard, KV cache shard and runner (vLLM's Worker).

The one place that builds a rank's model and what runs beside it: the linear methods (split
over the tensor-parallel group, wrapped by LoRA's), the sampler, the speculative proposer, the
LoRA manager, step graphs, the KV connector's worker side. The uniproc executor is one, in the
engine's process (groups of size 1); the multiproc and Ray executors hold one per rank in worker
processes, each in its tensor-parallel group (``TensorParallelGroup``) and pipeline stage
(``PipelineParallelGroup``). Every rank of the last stage runs the same step on its shard,
samples the same tokens from the gathered logits (the same seeds, the same draws), proposes the
same drafts and so keeps the same persistent batch; the first rank of the last stage is the
output rank, its output is the step's result. A stage before the last receives the previous
stage's hidden states and residual, runs its layers and sends them on without waiting for the
send (it computes the next batch meanwhile); it learns the sampled tokens from the next steps'
scheduler output.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

import torch

from llmkit.attention import attention_backend_class
from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.distributed.group import TensorParallelGroup
from llmkit.distributed.pipeline import IntermediateTensors, PendingSend, PipelineParallelGroup
from llmkit.facts import BackendInfo, ModelFacts
from llmkit.kv_cache.groups import describe_groups
from llmkit.kv_transfer.base import KVConnectorBase, KVConnectorRole, KVLayout
from llmkit.linear.parallel import tensor_parallel_factory
from llmkit.lora.base import LoRARequest
from llmkit.lora.manager import LoRAManager, LoRASetup
from llmkit.models.base import ModelContext
from llmkit.models.interfaces import supports_multimodal
from llmkit.models.pooling_config import resolve_pooling
from llmkit.models.loader import ModelSource, build_model, resolve_model_source, text_config
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.sampling import SAMPLERS
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode import ProposerEnv, build_proposer
from llmkit.worker.model_runner import ModelRunner
from llmkit.worker.pooling import PoolingRunner
from llmkit.worker.spec_setup import adaptive_length_policy, time_decode_step
from llmkit.worker.model_setup import (describe_backend, linear_method_factory, resolve_dtype,
                                       resolve_kv_cache_dtype)

logger = logging.getLogger(__name__)


def model_facts(source: ModelSource) -> ModelFacts:
    return ModelFacts(
        max_model_len=source.max_model_len,
        vocab_size=text_config(source.hf_config).vocab_size,
        eos_token_id=source.eos_token_ids[0] if source.eos_token_ids else None,
        eos_token_ids=tuple(source.eos_token_ids),
    )


def check_encoder_budget(model: torch.nn.Module, config: EngineConfig) -> None:
    """An image must fit the encoder cache and one step's encoder budget, or it could never
    be encoded: a multimodal model with a smaller setting fails at start-up."""
    if not supports_multimodal(model) or model.num_image_tokens is None:
        return
    n = model.num_image_tokens
    s = config.scheduler
    for key, value in (("scheduler.encoder_cache_size", s.encoder_cache_size),
                       ("scheduler.max_num_encoder_input_tokens",
                        s.max_num_encoder_input_tokens)):
        if value < n:
            raise ConfigError(key, value, f"an integer >= {n} (this model's tokens per image)")


class Worker:
    def __init__(self, config: EngineConfig, platform: Platform,
                 model_source: ModelSource | None = None,
                 tp: TensorParallelGroup = TensorParallelGroup(),
                 pp: PipelineParallelGroup = PipelineParallelGroup()) -> None:
        self.config = config
        self.platform = platform
        self.tp = tp
        self.pp = pp
        #: whether this rank's output is the step's result (the executor reads only it)
        self.is_output_rank = pp.is_last_rank and tp.rank == 0
        # sends to the next stage still in flight, oldest first
        self._sends: deque[PendingSend] = deque()
        single = tp.size == 1 and pp.size == 1
        source = model_source or resolve_model_source(config.model)
        dtype = resolve_dtype(config.model.dtype, platform)
        ops = platform.ops(dtype)
        attn = attention_backend_class(config.attention, platform).for_platform(platform, ops)
        # Several ranks keep float linear methods: the quantized methods' packed blocks are
        # not sliced per rank yet (said at start: the fast path is lost, not silently).
        # (an explicit model.quantization is refused before any rank starts: parallel_checks)
        if not single and source.quantization != "none":
            if tp.rank == 0 and pp.rank == 0:
                logger.warning("model.quantization=auto: the checkpoint is quantized (%s) but "
                               "several ranks serve it; dequantizing it to %s on every rank",
                               source.quantization, str(dtype).removeprefix("torch."))
        linear, quantization = linear_method_factory(
            config.model, platform, dtype, source.quantization if single else "none")
        lora = None
        if config.lora.enabled:
            lora = LoRASetup(config.lora, source, platform, dtype,
                             max_num_tokens=config.scheduler.max_num_batched_tokens)
            linear = lora.wrap(linear)
        linear = tensor_parallel_factory(linear, tp)
        ctx = ModelContext(attn_backend=attn, dtype=dtype, ops=ops, linear_method=linear, tp=tp,
                           enable_expert_parallel=config.parallel.enable_expert_parallel,
                           pp=pp, quantization=quantization, mla=config.model.mla)
        torch.manual_seed(config.seed)
        model = build_model(source, ctx, platform.device)
        check_encoder_budget(model, config)
        self._hidden = (model.hidden_size, dtype, platform.device)
        sampler = SAMPLERS.resolve(config.sampler.name, config.sampler.target).for_platform(
            platform, seed=config.seed)
        self._model_facts = model_facts(source)
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
        plan = self.runner.kv_plan
        if plan is not None:  # the engine's KV cache manager serves the same groups
            self._model_facts = replace(self._model_facts, kv_cache_groups=plan.groups,
                                        kv_block_size=plan.block_size)
        pooling = resolve_pooling(config.model, source)
        if pooling is not None:  # model.runner=pooling (llmkit/worker/pooling.py)
            self.runner.pooler = PoolingRunner(pooling)
        # Every rank builds the proposer (a draft model or EAGLE head split like the target,
        # with its ctx): the same tokens, seeds and gathered logits give every rank the same
        # drafts.
        self.runner.proposer = build_proposer(config.speculative, ProposerEnv(
            target=model, ctx=ctx, device=platform.device, max_model_len=source.max_model_len,
            block_size=self.runner.block_size, seed=config.seed))
        if plan is not None and not plan.single_table:
            if config.compilation.mode == "graphs":
                # Said once at start: the fast path is lost, not silently.
                logger.warning("compilation.mode=graphs: step graphs take one full-attention "
                               "block table and this model keeps %s; every step runs eagerly",
                               describe_groups(plan.groups))
        elif single and pooling is None:  # (pooling engines only prefill: eager steps)
            self.runner.make_step_graphs = lambda model, kv_caches: platform.step_graphs(
                model, kv_caches, config.compilation, config.scheduler.max_num_seqs)
            # Only a single rank builds graphs, so no rank can switch to them at another
            # step than its peers (their collectives would part). Adaptive K times the
            # graphs' steps at start-up, so it waits for them.
            spec = config.speculative
            times_steps = self.runner.proposer is not None and spec.adaptive and \
                spec.ridge_tokens is None
            self.runner.capture_in_background = config.compilation.background and \
                not times_steps
            self.runner.compile_missing_graphs = config.compilation.compile_missing or \
                times_steps
        elif config.compilation.mode == "graphs" and not single:
            logger.warning("compilation.mode=graphs: step graphs are not built under tensor or "
                           "pipeline parallel yet (their collectives, sends and receives); "
                           "rank %d runs every step eagerly", pp.global_rank(pp.rank))
        if lora is not None:
            self.runner.lora_manager = lora.manager(model)
            if config.compilation.mode == "graphs" and not lora.ops.supports_step_graphs:
                # Said once at start: the fast path is lost for those steps, not silently.
                logger.warning("LoRA: the %s LoRA ops cannot run inside step graphs; decode "
                               "steps where a row uses an adapter run eagerly (steps without "
                               "adapters still use the graphs)", lora.ops.name)

    @property
    def model_facts(self) -> ModelFacts:
        return self._model_facts

    @property
    def backend_info(self) -> BackendInfo:
        return describe_backend(self.runner, *self._names, self._dtype, self.platform)

    def kv_cache_bytes_per_block(self) -> int:
        """This rank's bytes per block (its KV heads only)."""
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        proposer = self.runner.proposer
        spec = self.config.speculative
        if proposer is not None and (spec.adaptive or spec.disable_by_batch_size):
            proposer.length_policy = adaptive_length_policy(
                spec, self.platform, self._time_step, self.config.scheduler.max_num_seqs)

    def _time_step(self, num_rows: int) -> float:
        """One decode step's seconds; under tensor parallel the ranks' mean, so that every
        rank takes the same measurement steps (each forward is a collective) and the same
        costs (the same K, the same drafts)."""
        seconds = time_decode_step(self.runner, num_rows)
        if self.tp.size == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.platform.device)
        return float(self.tp.all_reduce(t)[0]) / self.tp.size

    def kv_layout(self, fingerprint: str) -> KVLayout:
        return self.runner.kv_layout(fingerprint)

    def init_kv_connector(self, cls: type[KVConnectorBase], layout: KVLayout) -> None:
        self.runner.kv_connector = cls(self.config, KVConnectorRole.WORKER, layout)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_adapter(lora_id)

    def _lora_manager(self) -> LoRAManager:
        manager = self.runner.lora_manager
        if manager is None:
            raise ValueError("LoRA adapters need lora.enabled=true")
        return manager

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output (only the output rank's is read: a stage before the last returns
        an empty one)."""
        pp = self.pp
        if pp.size == 1:
            return self.runner.execute_model(scheduler_output)
        intermediate = None
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if not pp.is_first_rank and num_tokens:
            intermediate = pp.recv(num_tokens, *self._hidden)
        out = self.runner.execute_model(scheduler_output, intermediate)
        if not isinstance(out, IntermediateTensors):
            return out
        _, dtype, _ = self._hidden
        if out.hidden_states.dtype != dtype or out.residual.dtype != dtype:
            # the next stage receives the model's dtype (a CPU may compute bf16 layers in fp32)
            out = IntermediateTensors(out.hidden_states.to(dtype), out.residual.to(dtype))
        self._sends.append(pp.isend(out))
        # The next stage receives in step order, so the oldest send completes first; at most
        # two stay pending (their tensors are held until then).
        while len(self._sends) > 2:
            self._sends.popleft().wait()
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

    def shutdown(self) -> None:
        self.runner.kv_caches.clear()
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
