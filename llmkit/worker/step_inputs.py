"""A step's inputs: the persistent batch follows the scheduler, then the step's tensors are read
from it.

``update_states``: each step's ``SchedulerOutput`` removes the finished and preempted requests,
adds the new ones and appends the running ones' new blocks and tokens, together with the state
each request keeps on the worker (its RNG, the prompt logprobs it is owed, its images and
M-RoPE positions).

``prepare_inputs`` is the translation layer of the seed's chapter 14: from "request r computes
n tokens starting at position p, its blocks are B" to ``input_ids``, ``positions``,
``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``, and which rows sample
at which positions (``LogitsLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.scheduler.base import SchedulerOutput
from llmkit.worker.group_metadata import group_kv_metadata
from llmkit.worker.input_batch import InputBatch
from llmkit.worker.kv_cache_setup import KVCachePlan
from llmkit.worker.mm_inputs import MultimodalInputs
from llmkit.worker.mrope_positions import MRoPEPositions
from llmkit.worker.prompt_logprobs import PromptLogprobsState
from llmkit.worker.sampling_inputs import LogitsLayout

__all__ = ["StepInputs", "prepare_inputs", "update_states"]


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


def update_states(so: SchedulerOutput, b: InputBatch, *, device: torch.device,
                  generators: dict[str, torch.Generator],
                  prompt_logprobs: dict[str, PromptLogprobsState],
                  mm: MultimodalInputs | None, mrope: MRoPEPositions | None) -> None:
    """Apply ``so`` to the batch ``b`` and to the per-request maps (changed in place)."""
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
        if mrope is not None:
            mrope.remove_request(rid)
        if finished:
            generators.pop(rid, None)
        prompt_logprobs.pop(rid, None)
    for new in so.scheduled_new_reqs:
        if new.mm_features and mm is not None:
            mm.add_request(new.req_id, new.mm_features)
            if mrope is not None:
                mrope.add_request(new.req_id, new.num_prompt_tokens, new.mm_features)
        sp = new.sampling_params
        gen = None
        if sp.seed is not None:
            gen = generators.get(new.req_id)
            if gen is None:
                gen = torch.Generator(device).manual_seed(sp.seed)
                generators[new.req_id] = gen
        b.add_request(new, gen)
        # Owed only until the first token: a request resumed after that already has them.
        if sp.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
            prompt_logprobs[new.req_id] = PromptLogprobsState(
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


def prepare_inputs(batch: InputBatch, so: SchedulerOutput, block_size: int,
                   kv_plan: KVCachePlan | None, mrope: MRoPEPositions | None) -> StepInputs:
    """The step's inputs from ``batch`` (already updated with ``so``); ``kv_plan``: the pool of
    a model with several KV-cache groups; ``mrope``: an M-RoPE model's positions."""
    b = batch
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
    block_numbers = b.block_table[req_idx, positions // block_size].astype(np.int64)
    slot_mapping = block_numbers * block_size + positions % block_size
    seq_lens = computed + num_sched
    query_start_loc = np.concatenate(([0], cu))
    max_blocks = int(b.num_blocks[rows].max())
    # Rows whose step reaches the end of their known tokens produce a new token; a row
    # verifying K drafts computes logits at its last 1 + K positions.
    samples = seq_lens >= b.num_tokens[rows]
    spec = so.scheduled_spec_tokens
    req_ids = [b.req_ids[r] for r in rows]
    sample_idx = np.flatnonzero(samples)
    ends = cu[sample_idx]
    if spec:
        drafts = [spec.get(req_ids[i], []) for i in sample_idx.tolist()]
        num_logits = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64,
                                 count=len(drafts))
        logits_indices = (np.repeat(ends - num_logits, num_logits)
                          + LogitsLayout(sample_idx, num_logits, drafts).offsets)
    else:  # one logits row per sampling request: its last token
        drafts = [[] for _ in range(len(sample_idx))]
        num_logits = np.ones(len(sample_idx), dtype=np.int64)
        logits_indices = ends - 1
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
        block_size=block_size,
    )
    if b.num_groups > 1:
        group_kv_metadata(metadata, kv_plan, b, rows, req_idx, positions)
    rope_positions = None
    if mrope:
        rope_positions = torch.from_numpy(
            mrope.step_positions(req_ids, starts, computed, num_sched, positions))
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
