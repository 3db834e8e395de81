"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

``prepare_inputs`` is the translation layer of the seed's chapter 14: from "request r computes
n tokens starting at position p, its blocks are B" to ``input_ids``, ``positions``,
``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.outputs import ModelRunnerOutput
from llmkit.sampling.sampler import Sampler, SamplingMetadata
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.input_batch import InputBatch


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
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of hidden states to sample from
    sample_rows: np.ndarray  # batch rows that sample this step
    req_ids: list[str]  # scheduled requests, in batch-row order


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
        max_blocks = -(-(max_model_len + num_lookahead_tokens) // block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks)
        self.kv_caches: list[torch.Tensor] = []
        # A request's RNG lives until it finishes, so preemption does not replay its draws.
        self._generators: dict[str, torch.Generator] = {}

    # -- KV cache ------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        m = self.model
        shape = self.attn_backend.kv_cache_shape(1, self.block_size, m.num_kv_heads, m.head_dim)
        per_layer = int(np.prod(shape)) * torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return per_layer * m.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads,
                                                 m.head_dim)
        self.kv_caches = [_zeros(shape, self.kv_cache_dtype, self.device)
                          for _ in range(m.num_layers)]

    # -- persistent batch ------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        for rid in so.finished_req_ids:
            b.remove_request(rid)
            self._generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            b.remove_request(rid)
        for new in so.scheduled_new_reqs:
            seed = new.sampling_params.seed
            gen = None
            if seed is not None:
                gen = self._generators.get(new.req_id)
                if gen is None:
                    gen = self._generators[new.req_id] = torch.Generator().manual_seed(seed)
            b.add_request(new, gen)
        c = so.scheduled_cached_reqs
        for rid, block_ids, n_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = b.req_id_to_row[rid]
            b.append_block_ids(row, block_ids)
            b.num_computed_tokens[row] = n_computed

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
        # Rows whose step reaches the end of their known tokens produce a new token.
        samples = seq_lens >= b.num_tokens[rows]
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
        return StepInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            attn_metadata=self.attn_backend.build_metadata(metadata),
            logits_indices=torch.from_numpy(cu[samples] - 1),
            sample_rows=rows[samples],
            req_ids=[b.req_ids[r] for r in rows],
        )

    def _sampling_metadata(self, rows: np.ndarray, so: SchedulerOutput) -> SamplingMetadata:
        b = self.batch
        temperature = b.temperature[rows]
        greedy = temperature < 1e-5
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        generators = {i: g for i, r in enumerate(rows) if (g := b.generators[r]) is not None}
        token_mask = None
        if so.token_masks:
            vocab = None
            masks = []
            for r in rows:
                m = so.token_masks.get(b.req_ids[r])
                masks.append(m)
                if m is not None:
                    vocab = m.shape[-1]
            if vocab is not None:
                token_mask = torch.stack([
                    m if m is not None else torch.ones(vocab, dtype=torch.bool) for m in masks])
        random = ~greedy
        return SamplingMetadata(
            temperature=torch.from_numpy(temperature),
            all_greedy=bool(greedy.all()),
            top_k=torch.from_numpy(top_k) if (top_k[random] > 0).any() else None,
            top_p=torch.from_numpy(top_p) if (top_p[random] < 1.0).any() else None,
            min_p=torch.from_numpy(min_p) if (min_p[random] > 0.0).any() else None,
            generators=generators,
            token_mask=token_mask,
        )

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.prepare_inputs(so)
        hidden = self.model(inputs.input_ids.to(self.device), inputs.positions.to(self.device),
                            self.kv_caches, inputs.attn_metadata)
        sampled_by_row: dict[int, int] = {}
        if len(inputs.sample_rows):
            logits = self.model.compute_logits(hidden[inputs.logits_indices.to(self.device)])
            meta = self._sampling_metadata(inputs.sample_rows, so)
            tokens = self.sampler(logits.float(), meta).tolist()
            b = self.batch
            for row, tok in zip(inputs.sample_rows.tolist(), tokens):
                n = b.num_tokens[row]
                if n < self.max_model_len:
                    b.token_ids[row, n] = tok
                b.num_tokens[row] = n + 1
                sampled_by_row[row] = tok
        rows = [self.batch.req_id_to_row[r] for r in inputs.req_ids]
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[sampled_by_row[r]] if r in sampled_by_row else [] for r in rows],
        )
