"""Worker: one rank's model shard, KV cache shard and runner (vLLM's Worker).

The uniproc executor holds one in its own process; the multiproc and Ray executors hold one
per rank in worker processes, each in its tensor-parallel group (``TensorParallelGroup``) and
pipeline stage (``PipelineParallelGroup``). Every rank of the last stage runs the same step on
its shard, samples the same tokens from the gathered logits (the same seeds, the same draws)
and so keeps the same persistent batch; the first rank of the last stage is the output rank,
its output is the step's result. A stage before the last receives the previous stage's
hidden states and residual, runs its layers and sends them on without waiting for the send
(it computes the next batch meanwhile); it learns the sampled tokens from the next steps'
scheduler output.
"""
from __future__ import annotations

import logging
from collections import deque

import torch

from llmkit.attention import attention_backend_class
from llmkit.config.schema import EngineConfig
from llmkit.distributed.group import TensorParallelGroup
from llmkit.distributed.pipeline import IntermediateTensors, PendingSend, PipelineParallelGroup
from llmkit.facts import BackendInfo, ModelFacts
from llmkit.linear.parallel import tensor_parallel_factory
from llmkit.models.base import ModelContext
from llmkit.models.loader import ModelSource, build_model, resolve_model_source
from llmkit.outputs import ModelRunnerOutput
from llmkit.platforms.base import Platform
from llmkit.sampling import SAMPLERS
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.model_runner import ModelRunner
from llmkit.worker.model_setup import (describe_backend, linear_method_factory, resolve_dtype,
                                       resolve_kv_cache_dtype)

logger = logging.getLogger(__name__)

def model_facts(source: ModelSource) -> ModelFacts:
    return ModelFacts(
        max_model_len=source.max_model_len,
        vocab_size=source.hf_config.vocab_size,
        eos_token_id=source.eos_token_ids[0] if source.eos_token_ids else None,
        eos_token_ids=tuple(source.eos_token_ids),
    )


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
        source = model_source or resolve_model_source(config.model)
        dtype = resolve_dtype(config.model.dtype, platform)
        ops = platform.ops(dtype)
        attn = attention_backend_class(config.attention, platform)(ops)
        linear = tensor_parallel_factory(linear_method_factory(config.model, platform, dtype)[0], tp)
        ctx = ModelContext(attn_backend=attn, dtype=dtype, ops=ops, linear_method=linear, tp=tp,
                           enable_expert_parallel=config.parallel.enable_expert_parallel,
                           pp=pp)
        torch.manual_seed(config.seed)
        model = build_model(source, ctx, platform.device)
        self._hidden = (model.hidden_size, dtype, platform.device)
        sampler = SAMPLERS.resolve(config.sampler.name, config.sampler.target)(seed=config.seed)
        self.model_facts = model_facts(source)
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
        if tp.size == 1 and pp.size == 1:
            self.runner.make_step_graphs = lambda model, kv_caches: platform.step_graphs(
                model, kv_caches, config.compilation, config.scheduler.max_num_seqs)
        elif config.compilation.mode == "graphs":
            logger.warning("compilation.mode=graphs: step graphs are not built under tensor or "
                           "pipeline parallel yet (their collectives, sends and receives); "
                           "rank %d runs every step eagerly", pp.global_rank(pp.rank))

    @property
    def backend_info(self) -> BackendInfo:
        return describe_backend(self.runner, *self._names, self._dtype, self.platform)

    def kv_cache_bytes_per_block(self) -> int:
        """This rank's bytes per block (its KV heads only)."""
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

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
