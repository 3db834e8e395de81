"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

``prepare_inputs`` is the translation layer of the seed's chapter 14: from "request r computes
n tokens starting at position p, its blocks are B" to ``input_ids``, ``positions``,
``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``.
"""
from __future__ import annotations

import contextlib

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.compilation.base import StepGraphs
from llmkit.distributed.pipeline import IntermediateTensors
from llmkit.config.errors import ConfigError
from llmkit.kernels.kv_quant import cache_row_width
from llmkit.kernels.kv_quant import format_of as kv_quant_format_of
from llmkit.lora.manager import LoRAManager
from llmkit.kv_transfer.base import KVConnectorBase, KVLayout
from llmkit.models.interfaces import supports_mrope, supports_multimodal
from llmkit.outputs import LogprobsLists, ModelRunnerOutput
from llmkit.sampling.sampler import Sampler, SamplerOutput
from llmkit.scheduler.base import SchedulerOutput
from llmkit.spec_decode.base import Proposer, StepContext
from llmkit.worker import kv_connector_step, prompt_logprobs
from llmkit.worker.input_batch import InputBatch
from llmkit.worker.group_metadata import build_group_metadata, group_kv_metadata
from llmkit.worker.kv_cache_setup import (allocate_kv_caches, first_attention_cache,
                                          plan_kv_cache)
from llmkit.worker.mm_inputs import MultimodalInputs
from llmkit.worker.mrope_positions import MRoPEPositions
from llmkit.worker.pooling import PoolingRunner
from llmkit.worker.prompt_logprobs import PromptLogprobsState
from llmkit.worker.sampling_inputs import (LogitsLayout, build_sampling_metadata,
                                          record_sampled_tokens)
from llmkit.worker.step_graph_capture import BackgroundCapture, prepare_step_graphs

logger = logging.getLogger(__name__)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, numpy's calloc maps zero pages lazily: a 4 GiB KV pool costs
    nothing until used, where torch.zeros would write every byte at start-up (seconds)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata  # built by the backend only for eager steps
    logits_indices: torch.Tensor  # rows of hidden states to compute logits at
    logits: LogitsLayout  # which batch rows sample, and at how many positions each
    req_ids: list[str]  # scheduled requests, in batch-row order
    rows: np.ndarray  # their batch rows
    query_starts: np.ndarray  # per scheduled row: its first token's index in the flat batch
    computed: np.ndarray  # per scheduled row: tokens computed before this step
    num_scheduled: np.ndarray  # per scheduled row: tokens computed in this step
    samples: np.ndarray  # per scheduled row: its step reaches its last token (it samples)
    # M-RoPE models: the rotary positions ([3, tokens] while a prompt with images is
    # computed, else [tokens] with each request's delta added); None: ``positions``.
    rope_positions: torch.Tensor | None = None


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
        if kv_quant_format_of(kv_cache_dtype) is not None and model.head_dim % 4:
            # a row's float32 scale must sit 4-byte aligned after its head_dim codes
            raise ConfigError("kv_cache.cache_dtype", kv_quant_format_of(kv_cache_dtype).name,
                              f"auto, bfloat16 or float16 for this model (head_dim "
                              f"{model.head_dim} is not a multiple of 4)")
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
    def _cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One layer's pool shape; a quantized cache's rows hold ``head_dim`` codes and their
        scale (``llmkit.kernels.kv_quant``), so its last dimension is the row's width."""
        return self.attn_backend.kv_cache_shape(num_blocks, self.block_size, num_kv_heads,
                                                cache_row_width(head_dim, self.kv_cache_dtype))

    def kv_cache_bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block over every layer, in the pool's dtype (or ``dtype``'s)."""
        if self.kv_plan is not None:
            return self.kv_plan.bytes_per_block
        dtype = dtype or self.kv_cache_dtype
        m = self.model

        def nbytes(h: int, d: int) -> int:
            shape = self.attn_backend.kv_cache_shape(1, self.block_size, h,
                                                     cache_row_width(d, dtype))
            return int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()

        # A draft model's (or EAGLE head's) layers keep their KV in the same blocks.
        return (nbytes(m.num_kv_heads, m.head_dim) * m.num_layers
                + sum(nbytes(h, d) for h, d in self._proposer_kv_layers()))

    def _proposer_kv_layers(self) -> list[tuple[int, int]]:
        return self.proposer.kv_cache_layers() if self.proposer is not None else []

    def kv_layout(self, fingerprint: str) -> KVLayout:
        """The pool's layout, for KV connectors: the block axis found by comparing the shapes
        of one and two blocks. A quantized block's scales are inside its rows, so they travel
        wherever its bytes do."""
        m = self.model
        one = self._cache_shape(1, m.num_kv_heads, m.head_dim)
        two = self._cache_shape(2, m.num_kv_heads, m.head_dim)
        dim = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
        return KVLayout(num_layers=m.num_layers, block_shape=one[:dim] + one[dim + 1:],
                        block_dim=dim, dtype=str(self.kv_cache_dtype).removeprefix("torch."),
                        block_size=self.block_size, fingerprint=fingerprint)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        self.num_kv_blocks = num_blocks
        if self.kv_plan is not None:  # other specs than full attention: kv_cache_setup
            self.kv_caches = allocate_kv_caches(self.kv_plan, num_blocks, self.attn_backend,
                                                self.device)
            warm = first_attention_cache(self.kv_caches)
        else:
            shape = self._cache_shape(num_blocks, m.num_kv_heads, m.head_dim)
            self._log_kv_cache(num_blocks)
            conn = self.kv_connector
            owned = conn.allocate_kv_caches(shape, self.kv_cache_dtype, m.num_layers,
                                            self.device) if conn is not None else None
            self.kv_caches = owned if owned is not None else [
                _zeros(shape, self.kv_cache_dtype, self.device) for _ in range(m.num_layers)]
            if conn is not None:
                conn.register_kv_caches(self.kv_caches)
            warm = self.kv_caches[0]
        if warm is not None:
            self.attn_backend.warm_up(warm, m.num_heads, self.kv_cache_dtype)
        draft_layers = self._proposer_kv_layers()
        if draft_layers:
            self.proposer.bind_kv_caches([
                _zeros(self._cache_shape(num_blocks, h, d), self.kv_cache_dtype, self.device)
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

    def _log_kv_cache(self, num_blocks: int) -> None:
        """Start-up says what a quantized (or narrower) cache buys: blocks in the same memory."""
        model_dtype = getattr(self.model, "dtype", None)
        if not isinstance(model_dtype, torch.dtype) or model_dtype == self.kv_cache_dtype:
            return
        fmt = kv_quant_format_of(self.kv_cache_dtype)
        name = fmt.name if fmt is not None else str(self.kv_cache_dtype).removeprefix("torch.")
        mine, theirs = self.kv_cache_bytes_per_block(), self.kv_cache_bytes_per_block(model_dtype)
        logger.info("KV cache %s%s: %d bytes a block vs %d at %s, %.2fx the blocks in the same "
                    "memory (%d blocks)", name,
                    " (codes + a float32 scale per token and KV head)" if fmt else "", mine,
                    theirs, str(model_dtype).removeprefix("torch."), theirs / mine, num_blocks)

    # -- persistent batch ------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        mm = self.mm
        if mm is not None:
            mm.free(so.free_encoder_mm_hashes)
        # Sorted: a set's order follows the process's string hashing, and every tensor-parallel
        # rank must lay out its rows alike (the same removals in the same order), or the ranks'
        # sampled drafts part. A preempted request keeps its RNG (preemption does not replay
        # its draws); its prompt logprobs are recomputed from scratch on resumption.
        for rid, finished in [(r, True) for r in sorted(so.finished_req_ids)] + \
                [(r, False) for r in sorted(so.preempted_req_ids)]:
            b.remove_request(rid)
            if mm is not None:
                mm.remove_request(rid)
            if self._mrope is not None:
                self._mrope.remove_request(rid)
            if finished:
                self._generators.pop(rid, None)
            self._prompt_logprobs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.mm_features and mm is not None:
                mm.add_request(new.req_id, new.mm_features)
                if self._mrope is not None:
                    self._mrope.add_request(new.req_id, new.num_prompt_tokens, new.mm_features)
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = self._generators.get(new.req_id)
                if gen is None:
                    gen = torch.Generator(self.device).manual_seed(sp.seed)
                    self._generators[new.req_id] = gen
            b.add_request(new, gen)
            # Owed only until the first token: a request resumed after that already has them.
            if sp.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
                self._prompt_logprobs[new.req_id] = PromptLogprobsState(
                    sp.prompt_logprobs, new.num_prompt_tokens)
        c = so.scheduled_cached_reqs
        offsets = c.block_ids_offset or [None] * len(c.req_ids)
        grouped = b.grouped
        for rid, block_ids, n_computed, offset in zip(c.req_ids, c.new_block_ids,
                                                      c.num_computed_tokens, offsets):
            row = b.req_id_to_row[rid]
            if grouped:
                b.set_group_block_ids(row, block_ids, offset)
            else:
                if offset is not None:
                    b.num_blocks[row] = offset  # blocks past it were given back
                b.append_block_ids(row, block_ids)
            b.num_computed_tokens[row] = n_computed
        # Pipeline parallel: the step's tokens (a stage that does not sample learns the last
        # stage's samples here; the last stage has them already).
        for rid, n_computed, toks in zip(c.req_ids, c.num_computed_tokens, c.new_token_ids):
            row = b.req_id_to_row[rid]
            end = n_computed + len(toks)
            b.token_ids[row, n_computed:end] = toks
            b.num_tokens[row] = max(int(b.num_tokens[row]), end)
        # Draft tokens sit after the known tokens while they are verified; accepted ones are
        # written again (the same ids) when the step's output is recorded.
        for rid, drafts in so.scheduled_spec_tokens.items():
            row = b.req_id_to_row[rid]
            n = b.num_tokens[row]
            b.token_ids[row, n:n + len(drafts)] = drafts

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b = self.batch
        rows = np.fromiter((b.req_id_to_row[r] for r in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64,
                                count=len(rows))
        order = np.argsort(rows, kind="stable")  # batch-row order keeps sampling params aligned
        rows, num_sched = rows[order], num_sched[order]
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        starts = cu - num_sched
        req_idx = np.repeat(rows, num_sched)
        offsets = np.arange(total) - np.repeat(starts, num_sched)
        computed = b.num_computed_tokens[rows]
        positions = np.repeat(computed, num_sched) + offsets
        input_ids = b.token_ids[req_idx, positions]
        block_numbers = b.block_table[req_idx, positions // self.block_size].astype(np.int64)
        slot_mapping = block_numbers * self.block_size + positions % self.block_size
        seq_lens = computed + num_sched
        query_start_loc = np.concatenate(([0], cu))
        max_blocks = int(b.num_blocks[rows].max())
        # Rows whose step reaches the end of their known tokens produce a new token; a row
        # verifying K drafts computes logits at its last 1 + K positions.
        samples = seq_lens >= b.num_tokens[rows]
        spec = so.scheduled_spec_tokens
        req_ids = [b.req_ids[r] for r in rows]
        sample_idx = np.flatnonzero(samples)
        drafts = [spec.get(req_ids[i], []) for i in sample_idx.tolist()] if spec else \
            [[] for _ in range(len(sample_idx))]
        num_logits = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64,
                                 count=len(drafts))
        ends = cu[sample_idx]
        logits_indices = (np.repeat(ends - num_logits, num_logits)
                          + LogitsLayout(sample_idx, num_logits, drafts).offsets)
        metadata = AttentionMetadata(
            num_reqs=len(rows),
            num_actual_tokens=total,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(b.block_table[rows, :max_blocks]),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=self.block_size,
        )
        if b.num_groups > 1:
            group_kv_metadata(metadata, self.kv_plan, b, rows, req_idx, positions)
        rope_positions = None
        if self._mrope:
            rope_positions = torch.from_numpy(
                self._mrope.step_positions(req_ids, starts, computed, num_sched, positions))
        return StepInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            rope_positions=rope_positions,
            attn_metadata=metadata,
            logits_indices=torch.from_numpy(logits_indices),
            logits=LogitsLayout(rows[sample_idx], num_logits, drafts),
            req_ids=req_ids,
            rows=rows,
            query_starts=starts,
            computed=computed,
            num_scheduled=num_sched,
            samples=samples,
        )

    # -- one step --------------------------------------------------------------------------
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
        prompt_lps = self._score_prompts(inputs, hidden) if self._prompt_logprobs else {}
        sampled_by_row: dict[int, list[int]] = {}
        logprobs: dict[str, LogprobsLists] = {}
        layout = inputs.logits
        if len(layout.rows):
            logits = self.model.compute_logits(hidden[inputs.logits_indices.to(self.device)])
            bitmask_rows = None
            if so.grammar_bitmask is not None:
                bitmask_rows = self._bitmask_rows(so)
            meta = build_sampling_metadata(self.batch, layout, logits.shape[-1], self.device,
                                           bitmask_rows, so.grammar_bitmask)
            if meta.spec is not None and self.proposer is not None:
                meta.spec.draft_probs = self._draft_probs(layout, logits.shape[-1])
            out = self.sampler.sample(logits.float(), meta)
            sampled_by_row = self._record(layout, out, logprobs)
            if so.scheduled_spec_tokens and self.proposer is not None and \
                    self.proposer.observes_acceptance:
                self._observe_acceptance(so.scheduled_spec_tokens, sampled_by_row)
        drafts = {}
        if self.proposer is not None:
            # Every step, also one where nothing samples: a draft model's KV must cover every
            # token the target computed.
            drafts = self.proposer.propose(self.batch, layout.rows, StepContext(
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

    def _observe_acceptance(self, spec_tokens: dict[str, list[int]],
                            sampled_by_row: dict[int, list[int]]) -> None:
        """Drafts and accepted drafts of each verified row, for adaptive K's estimate."""
        req_ids = self.batch.req_ids
        drafted, accepted = [], []
        for row, tokens in sampled_by_row.items():
            drafts = spec_tokens.get(req_ids[row])
            if drafts:
                drafted.append(len(drafts))
                accepted.append(len(tokens) - 1)
        if drafted:
            self.proposer.observe_acceptance(np.array(drafted), np.array(accepted))

    def _draft_probs(self, layout: LogitsLayout, vocab_size: int) -> torch.Tensor | None:
        """q per logits row when the proposer drew its drafts from a distribution (one-hot rows
        for drafts given as tokens, zero rows for bonus positions); None if it never did."""
        probs = [self.proposer.draft_probs(self.batch.req_ids[r], d) if d else None
                 for r, d in zip(layout.rows.tolist(), layout.drafts)]
        if all(p is None for p in probs):
            return None
        q = torch.zeros(int(layout.num_logits.sum()), vocab_size, device=self.device)
        start = 0
        for p, d, n in zip(probs, layout.drafts, layout.num_logits.tolist()):
            if p is not None:
                q[start:start + len(d)] = p
            elif d:
                q[torch.arange(start, start + len(d), device=self.device),
                  torch.tensor(d, device=self.device)] = 1.0
            start += n
        return q

    def _forward(self, inputs: StepInputs, inputs_embeds: torch.Tensor | None = None,
                 intermediate_tensors: IntermediateTensors | None = None
                 ) -> torch.Tensor | IntermediateTensors:
        """The model's hidden states: through a step graph for a decode-only step it covers,
        else eagerly; a KV connector's per-layer calls inside or around it
        (``kv_connector_step``)."""
        graph = (inputs_embeds is None and intermediate_tensors is None
                 and self._graph_step(inputs))
        pending = self.pending_graphs
        with (pending.eager_step() if pending is not None else contextlib.nullcontext()):
            conn = self.kv_connector
            if conn is None:
                return self._forward_once(inputs, inputs_embeds, intermediate_tensors, graph,
                                          False)
            return kv_connector_step.forward_with_connector(
                conn, self.kv_caches,
                lambda hooked: self._forward_once(inputs, inputs_embeds, intermediate_tensors,
                                                  graph, hooked),
                layer_hook=not graph and self.model.supports_kv_layer_hook)

    def _graph_step(self, inputs: StepInputs) -> bool:
        """Whether a step graph computes this step: a decode-only step it covers, or
        decoding rows verifying drafts (with one position row: M-RoPE prompts run eagerly)."""
        graphs = self.step_graphs
        md = inputs.attn_metadata
        if graphs is None or not graphs.covers(md.num_actual_tokens) or not (
                self.lora_manager is None or self.lora_manager.step_graphs_allowed):
            return False
        if inputs.rope_positions is not None and inputs.rope_positions.dim() > 1:
            return False
        if md.num_actual_tokens == md.num_reqs:
            return True
        layout = inputs.logits
        return len(layout.rows) == len(inputs.rows) and bool(
            (layout.num_logits == inputs.num_scheduled).all())

    def _forward_once(self, inputs: StepInputs, inputs_embeds: torch.Tensor | None,
                      intermediate_tensors: IntermediateTensors | None, graph: bool,
                      hooked: bool) -> torch.Tensor | IntermediateTensors:
        md = inputs.attn_metadata
        ids, positions = inputs.input_ids.to(self.device), inputs.positions.to(self.device)
        rope = positions if inputs.rope_positions is None else \
            inputs.rope_positions.to(self.device)
        if graph:
            rows = inputs.rows
            if md.num_actual_tokens == md.num_reqs:
                return self.step_graphs.run(
                    ids, rope, md.slot_mapping.to(self.device),
                    torch.from_numpy(self.batch.block_table[rows]).to(self.device),
                    md.seq_lens.to(self.device))
            # Decoding rows verifying drafts: each token is a decode row over its context up
            # to itself (every K/V is written before attention), so the decode graph computes
            # the step with one block-table row and length per token.
            per_token = np.repeat(rows, inputs.num_scheduled)
            return self.step_graphs.run(
                ids, rope, md.slot_mapping.to(self.device),
                torch.from_numpy(self.batch.block_table[per_token]).to(self.device),
                (positions + 1).to(torch.int32))
        built = self.attn_backend.build_metadata(md) if not md.group_metadata else \
            build_group_metadata(self.attn_backend, md, self.kv_plan)
        if hooked:
            built.kv_layer_hook = self.kv_connector
        if intermediate_tensors is not None:  # a later pipeline stage (no step graphs)
            return self.model(None, rope, self.kv_caches, built,
                              intermediate_tensors=intermediate_tensors)
        if inputs_embeds is not None:
            return self.model(None, rope, self.kv_caches, built, inputs_embeds)
        return self.model(ids, rope, self.kv_caches, built)

    @staticmethod
    def _bitmask_rows(so: SchedulerOutput) -> dict[str, int]:
        """Each constrained request's first bitmask row (1 + its drafts rows each)."""
        rows, start = {}, 0
        for rid in so.structured_output_request_ids:
            rows[rid] = start
            start += 1 + len(so.scheduled_spec_tokens.get(rid, ()))
        return rows

    def _record(self, layout: LogitsLayout, out: SamplerOutput,
                logprobs: dict[str, LogprobsLists]) -> dict[int, list[int]]:
        """Append the new tokens to the batch; collect logprobs of rows that asked."""
        b = self.batch
        rows = layout.rows
        row_list = rows.tolist()
        if out.output_token_ids is not None:
            tokens = out.output_token_ids
        else:
            tokens = [[t] for t in out.sampled_token_ids.tolist()]
        for row, toks in zip(row_list, tokens):
            n = b.num_tokens[row]
            end = min(n + len(toks), self.max_model_len)
            b.token_ids[row, n:end] = toks[:end - n]
            b.num_tokens[row] = n + len(toks)
        record_sampled_tokens(b, rows, tokens)
        if out.logprobs is not None:
            num_lp = b.num_logprobs[rows]
            lists = out.logprobs.to_lists()
            starts = np.cumsum(layout.num_logits) - layout.num_logits
            for i in np.flatnonzero(num_lp >= 0).tolist():
                k = int(num_lp[i]) + 1  # rows were computed with the batch's largest k
                s0, n = int(starts[i]), len(tokens[i])
                logprobs[b.req_ids[row_list[i]]] = LogprobsLists(
                    [ids[:k] for ids in lists.token_ids[s0:s0 + n]],
                    [lps[:k] for lps in lists.logprobs[s0:s0 + n]], lists.ranks[s0:s0 + n])
        return dict(zip(row_list, tokens))

    def _score_prompts(self, inputs: StepInputs,
                       hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Prompt logprobs of this step's chunks; the full list of each prompt it completes."""
        done: dict[str, LogprobsLists] = {}
        for i, rid in enumerate(inputs.req_ids):
            state = self._prompt_logprobs.get(rid)
            if state is None:
                continue
            row = int(inputs.rows[i])
            compute_logits = self.model.compute_logits
            if self.lora_manager is not None:  # the rows are this request's: its adapter
                compute_logits = self.lora_manager.logits_fn(int(self.batch.lora_id[row]),
                                                             compute_logits)
            prompt_logprobs.score_chunk(state, hidden, compute_logits,
                                        self.batch.token_ids[row], int(inputs.query_starts[i]),
                                        int(inputs.computed[i]), int(inputs.num_scheduled[i]))
            if prompt_logprobs.finished(state):
                done[rid] = prompt_logprobs.collect(state)
                del self._prompt_logprobs[rid]
        return done
