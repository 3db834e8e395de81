"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

One step (``execute_model``) in the order it runs:

1. ``input_batch``: the persistent batch follows the scheduler's output, and the step's
   tensors are read from it;
2. the model's forward (here, ``_forward``), through a step graph or eagerly, a KV
   connector's calls around it (``kv_connector_step``), images encoded before it
   (``mm_inputs``);
3. ``sample_step`` (or ``pooling`` for ``model.runner=pooling``): logits, sampling, the new
   tokens recorded; ``prompt_logprobs`` scores prompts;
4. the proposer drafts the next step's speculative tokens.

The KV cache's memory is made once, after profiling: ``kv_cache_pool`` (full attention only)
or ``kv_cache_setup`` (other layer kinds); the step graphs then (``step_graph_capture``).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend
from llmkit.compilation.base import StepGraphs
from llmkit.distributed.pipeline import IntermediateTensors
from llmkit.lora.manager import LoRAManager
from llmkit.kv_transfer.base import KVConnectorBase, KVLayout
from llmkit.models.interfaces import supports_mrope, supports_multimodal
from llmkit.outputs import ModelRunnerOutput
from llmkit.sampling.sampler import Sampler
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode.base import Proposer, StepContext
from llmkit.worker import input_batch, kv_cache_pool, kv_connector_step, prompt_logprobs
from llmkit.worker.group_metadata import build_group_metadata
from llmkit.worker.input_batch import InputBatch, StepInputs
from llmkit.worker.kv_cache_setup import (allocate_kv_caches, first_attention_cache,
                                          plan_kv_cache)
from llmkit.worker.mm_inputs import MultimodalInputs
from llmkit.worker.mrope_positions import MRoPEPositions
from llmkit.worker.pooling import PoolingRunner
from llmkit.worker.prompt_logprobs import PromptLogprobsState
from llmkit.worker.sample_step import sample_step
from llmkit.worker.step_graph_capture import BackgroundCapture, prepare_step_graphs

__all__ = ["ModelRunner", "StepInputs"]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, sampler: Sampler,
                 *, max_num_reqs: int, max_model_len: int, block_size: int,
                 num_lookahead_tokens: int, kv_cache_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        kv_cache_pool.check_row_alignment(model, kv_cache_dtype)
        # A model whose layers keep other state than full attention (llmkit/kv_cache/groups.py):
        # its pool's layout, which may raise the block size; None keeps the one-table path.
        specs = model.kv_cache_specs() if hasattr(model, "kv_cache_specs") else None
        self.kv_plan = plan_kv_cache(specs, block_size, kv_cache_dtype,
                                     getattr(model, "dtype", None) or kv_cache_dtype,
                                     attn_backend) if specs else None
        if self.kv_plan is not None:
            self.block_size = block_size = self.kv_plan.block_size
        max_blocks = -(-(max_model_len + num_lookahead_tokens) // block_size)
        plan = self.kv_plan
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks,
                                plan.num_groups if plan is not None else 1,
                                grouped=plan is not None and not plan.single_table)
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        # A request's RNG lives until it finishes, so preemption does not replay its draws.
        self._generators: dict[str, torch.Generator] = {}
        # Requests still owed their prompt logprobs, accumulated across prefill chunks.
        self._prompt_logprobs: dict[str, PromptLogprobsState] = {}
        # Speculative decoding: proposes draft tokens after each step's sampling.
        self.proposer: Proposer | None = None
        # Step graphs (compilation.mode=graphs): made once the KV cache exists.
        self.make_step_graphs: Callable[[torch.nn.Module, list[torch.Tensor]],
                                        StepGraphs | None] | None = None
        self.step_graphs: StepGraphs | None = None  # set once they are ready to run
        # Compile step graphs on a daemon thread when nothing saved covers them, stepping
        # eagerly meanwhile (compilation.background; the worker turns it off where it must).
        self.capture_in_background = False
        #: false: graphs that were not saved by an earlier start are not compiled (eager)
        self.compile_missing_graphs = True
        self.pending_graphs: BackgroundCapture | None = None
        # Multi-LoRA: the model's adapter slots; sets each step's row -> slot mapping.
        self.lora_manager: LoRAManager | None = None
        # Multimodal: each running request's images and the encoder outputs by image content
        # hash (what the scheduler's EncoderCacheManager accounts for). Absent for a text-only
        # model: its steps never look for images.
        self.mm = MultimodalInputs(device) if supports_multimodal(model) else None
        # M-RoPE (Qwen2-VL): the positions of each running request with images.
        self.uses_mrope = supports_mrope(model)
        self._mrope = MRoPEPositions(model) if self.uses_mrope else None
        # KV connector, worker side (llmkit/kv_transfer): loads before and saves after the
        # forward; it may own the pool's memory (a shared-memory producer).
        self.kv_connector: KVConnectorBase | None = None
        # model.runner=pooling: each prompt's embedding instead of sampled tokens.
        self.pooler: PoolingRunner | None = None

    # -- KV cache ------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block over every layer, in the pool's dtype (or ``dtype``'s)."""
        if self.kv_plan is not None:
            return self.kv_plan.bytes_per_block
        return kv_cache_pool.bytes_per_block(
            self.attn_backend, self.block_size, dtype or self.kv_cache_dtype,
            kv_cache_pool.model_layers(self.model, self._proposer_kv_layers()))

    def _proposer_kv_layers(self) -> list[tuple[int, int]]:
        return self.proposer.kv_cache_layers() if self.proposer is not None else []

    def kv_layout(self, fingerprint: str) -> KVLayout:
        return kv_cache_pool.kv_layout(self.model, self.attn_backend, self.block_size,
                                       self.kv_cache_dtype, fingerprint)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The pool of ``num_blocks`` blocks, a draft model's layers in the same blocks, and
        then the step graphs (they hold the pool)."""
        self.num_kv_blocks = num_blocks
        draft_layers = self._proposer_kv_layers()
        if self.kv_plan is not None:  # other specs than full attention: kv_cache_setup
            self.kv_caches = allocate_kv_caches(self.kv_plan, num_blocks, self.attn_backend,
                                                self.device)
            warm = first_attention_cache(self.kv_caches)
        else:
            self.kv_caches = kv_cache_pool.allocate(
                self.model, self.attn_backend, self.block_size, self.kv_cache_dtype,
                num_blocks, self.device, self.kv_connector, draft_layers)
            warm = self.kv_caches[0]
        if warm is not None:
            self.attn_backend.warm_up(warm, self.model.num_heads, self.kv_cache_dtype)
        if draft_layers:
            self.proposer.bind_kv_caches([
                kv_cache_pool.zeros(kv_cache_pool.layer_shape(
                    self.attn_backend, num_blocks, self.block_size, h, d, self.kv_cache_dtype),
                    self.kv_cache_dtype, self.device)
                for h, d in draft_layers])
        if self.make_step_graphs is not None:
            graphs = self.make_step_graphs(self.model, self.kv_caches)
            if graphs is not None:
                self.step_graphs, self.pending_graphs = prepare_step_graphs(
                    graphs, self.batch.block_table.shape[1],
                    background=self.capture_in_background,
                    compile_missing=self.compile_missing_graphs)

    def _poll_step_graphs(self) -> None:
        """Swap in the background capture's graphs once ready: between steps, on the engine
        thread, so a step runs wholly eager or wholly through the graphs."""
        pending = self.pending_graphs
        if pending is None or not pending.done:
            return
        self.pending_graphs = None
        self.step_graphs = pending.poll()

    # -- one step --------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        input_batch.update_states(so, self.batch, device=self.device,
                                  generators=self._generators,
                                  prompt_logprobs=self._prompt_logprobs, mm=self.mm,
                                  mrope=self._mrope)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        return input_batch.prepare_inputs(self.batch, so, self.block_size, self.kv_plan,
                                          self._mrope)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors:
        """The step's output; a pipeline stage before the last returns the tensors the next
        stage continues from (``intermediate_tensors``: what the previous stage sent)."""
        if self.pending_graphs is not None:
            self._poll_step_graphs()
        self._update_states(so)
        conn = self.kv_connector
        if conn is not None:
            kv_connector_step.start_step(conn, so.kv_connector_metadata)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], kv_connector_output=(
                kv_connector_step.finish_without_forward(conn, len(self.kv_caches),
                                                         so.finished_req_ids)
                if conn is not None else None))
        inputs = self.prepare_inputs(so)
        if self.lora_manager is None:
            return self._execute(so, inputs, intermediate_tensors)
        layout = inputs.logits
        row_lora = self.batch.lora_id[inputs.rows]
        self.lora_manager.prepare_step(np.repeat(row_lora, inputs.num_scheduled),
                                       np.repeat(self.batch.lora_id[layout.rows],
                                                 layout.num_logits))
        try:
            return self._execute(so, inputs)
        finally:
            self.lora_manager.end_step()

    def _execute(self, so: SchedulerOutput, inputs: StepInputs,
                 intermediate_tensors: IntermediateTensors | None = None
                 ) -> ModelRunnerOutput | IntermediateTensors:
        conn = self.kv_connector
        mm = self.mm
        inputs_embeds = None
        if mm is not None:
            if so.scheduled_encoder_inputs:
                mm.encode(self.model, so.scheduled_encoder_inputs)
            if mm:
                inputs_embeds = mm.embeddings(
                    self.model, inputs.input_ids, inputs.req_ids, inputs.computed,
                    inputs.num_scheduled, inputs.query_starts)
        hidden = self._forward(inputs, inputs_embeds, intermediate_tensors)
        if isinstance(hidden, IntermediateTensors):
            return hidden  # a pipeline stage before the last: nothing samples here
        if conn is not None:
            conn.wait_for_save()
        if self.pooler is not None:  # model.runner=pooling: embeddings, no logits
            return self.pooler.step_output(
                inputs.req_ids, inputs.query_starts, inputs.computed, inputs.num_scheduled,
                self.batch.num_tokens[inputs.rows], hidden,
                so.finished_req_ids | so.preempted_req_ids)
        prompt_lps = prompt_logprobs.score_step(
            self._prompt_logprobs, inputs, hidden, self.batch, self.model.compute_logits,
            self.lora_manager) if self._prompt_logprobs else {}
        sampled_by_row, logprobs = sample_step(self, so, inputs, hidden)
        drafts = {}
        if self.proposer is not None:
            # Every step, also one where nothing samples: a draft model's KV must cover every
            # token the target computed.
            drafts = self.proposer.propose(self.batch, inputs.logits.rows, StepContext(
                rows=inputs.rows, computed=inputs.computed,
                num_scheduled=inputs.num_scheduled, query_starts=inputs.query_starts,
                samples=inputs.samples, hidden_states=hidden))
        rows = inputs.rows.tolist()
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[sampled_by_row.get(r, []) for r in rows],
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            draft_token_ids=drafts,
            kv_connector_output=(conn.get_finished(so.finished_req_ids) if conn is not None
                                 else None),
        )

    # -- the forward -------------------------------------------------------------------------
    # Through a step graph where one computes the step, else eagerly with the attention
    # backend's metadata; a KV connector's per-layer calls inside or around it
    # (``kv_connector_step``); pipeline stages after the first continue from the previous
    # stage's tensors. The step graphs (``compilation.mode=graphs``, made in
    # ``step_graph_capture``) are decode steps of up to ``max_rows`` rows with one block-table
    # row and one sequence length per row. They compute a decode-only step, and decoding rows
    # verifying drafts: each draft token is then a decode row over its context up to itself
    # (every K/V is written before attention).
    def _forward(self, inputs: StepInputs, inputs_embeds: torch.Tensor | None = None,
                 intermediate_tensors: IntermediateTensors | None = None
                 ) -> torch.Tensor | IntermediateTensors:
        """The model's hidden states (or, before the last pipeline stage, the tensors the next
        stage continues from)."""
        graph = (inputs_embeds is None and intermediate_tensors is None
                 and _graph_computes(self.step_graphs, self.lora_manager, inputs))
        pending = self.pending_graphs
        # While graphs compile in the background, an eager step waits out any torch.fx trace
        # (step_graph_capture explains why).
        with (pending.eager_step() if pending is not None else contextlib.nullcontext()):
            conn = self.kv_connector
            if conn is None:
                return self._forward_once(inputs, inputs_embeds, intermediate_tensors,
                                          graph, False)
            return kv_connector_step.forward_with_connector(
                conn, self.kv_caches,
                lambda hooked: self._forward_once(inputs, inputs_embeds,
                                                  intermediate_tensors, graph, hooked),
                layer_hook=not graph and self.model.supports_kv_layer_hook)

    def _forward_once(self, inputs: StepInputs, inputs_embeds: torch.Tensor | None,
                      intermediate_tensors: IntermediateTensors | None, graph: bool,
                      hooked: bool) -> torch.Tensor | IntermediateTensors:
        device = self.device
        md = inputs.attn_metadata
        ids, positions = inputs.input_ids.to(device), inputs.positions.to(device)
        rope = positions if inputs.rope_positions is None else inputs.rope_positions.to(device)
        if graph:
            return _run_graph(self.step_graphs, self.batch.block_table, inputs, ids,
                              positions, rope, device)
        built = self.attn_backend.build_metadata(md) if not md.group_metadata else \
            build_group_metadata(self.attn_backend, md, self.kv_plan)
        if hooked:
            built.kv_layer_hook = self.kv_connector
        model, kv_caches = self.model, self.kv_caches
        if intermediate_tensors is not None:  # a later pipeline stage (no step graphs)
            return model(None, rope, kv_caches, built,
                         intermediate_tensors=intermediate_tensors)
        if inputs_embeds is not None:
            return model(None, rope, kv_caches, built, inputs_embeds)
        return model(ids, rope, kv_caches, built)


def _graph_computes(graphs: StepGraphs | None, lora_manager: LoRAManager | None,
                   inputs: StepInputs) -> bool:
    """Whether a step graph computes this step: a decode-only step it covers, or decoding
    rows verifying drafts (with one position row: M-RoPE prompts run eagerly)."""
    md = inputs.attn_metadata
    if graphs is None or not graphs.covers(md.num_actual_tokens) or not (
            lora_manager is None or lora_manager.step_graphs_allowed):
        return False
    if inputs.rope_positions is not None and inputs.rope_positions.dim() > 1:
        return False
    if md.num_actual_tokens == md.num_reqs:
        return True
    layout = inputs.logits
    return len(layout.rows) == len(inputs.rows) and bool(
        (layout.num_logits == inputs.num_scheduled).all())


def _run_graph(graphs: StepGraphs, block_table: np.ndarray, inputs: StepInputs,
              ids: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor,
              device: torch.device) -> torch.Tensor:
    """The step's hidden states through the graphs (``_graph_computes`` held); ``ids``,
    ``positions`` and ``rope`` already on ``device``; ``block_table`` the batch's."""
    md = inputs.attn_metadata
    rows = inputs.rows
    if md.num_actual_tokens == md.num_reqs:
        return graphs.run(ids, rope, md.slot_mapping.to(device),
                          torch.from_numpy(block_table[rows]).to(device),
                          md.seq_lens.to(device))
    # Verifying drafts: one block-table row and length per token.
    per_token = np.repeat(rows, inputs.num_scheduled)
    return graphs.run(ids, rope, md.slot_mapping.to(device),
                      torch.from_numpy(block_table[per_token]).to(device),
                      (positions + 1).to(torch.int32))
