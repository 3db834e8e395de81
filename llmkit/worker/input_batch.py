"""The persistent batch, and each step's inputs read from it.

The batch keeps per-request state across steps in preallocated arrays. Rows are kept dense
(0..num_reqs-1): removing a request moves the last row into its place, so building a step's
inputs is a handful of vectorised numpy ops, not a Python loop per token. Sampling parameters
live in per-row numpy columns (for vectorised per-step checks: does any row of this step need
penalties, top-k, ...); the few ragged ones (bias, allow-lists, bad words, penalty counts) in a
per-row :class:`RowSamplingExtras`.

Each step, ``update_states`` applies the ``SchedulerOutput`` to it: the finished and preempted
requests leave, the new ones join, the running ones get their new blocks and tokens, together
with the state each request keeps on the worker (its RNG, the prompt logprobs it is owed, its
images and M-RoPE positions). ``prepare_inputs`` is then the translation layer of the seed's
chapter 14: from "request r computes n tokens starting at position p, its blocks are B" to
``input_ids``, ``positions``, ``slot_mapping``, ``block_table``, ``query_start_loc`` and
``seq_lens``, and which rows sample at which positions (``LogitsLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.base import NewRequestData, SchedulerOutput
from llmkit.worker.group_metadata import group_kv_metadata
from llmkit.worker.kv_cache_setup import KVCachePlan
from llmkit.worker.mm_inputs import MultimodalInputs
from llmkit.worker.mrope_positions import MRoPEPositions
from llmkit.worker.prompt_logprobs import PromptLogprobsState


class GrowingIds:
    """Distinct token ids in first-seen order, with a count each, as numpy arrays that grow
    by doubling: a step reads them as slices (no per-step conversion), a new token is O(1)."""

    __slots__ = ("ids", "counts", "n", "_pos")

    def __init__(self, tokens: list[int]) -> None:
        self.ids = np.empty(max(16, 2 * len(tokens)), dtype=np.int64)
        self.counts = np.zeros(len(self.ids), dtype=np.int64)
        self.n = 0
        self._pos: dict[int, int] = {}
        for t in tokens:
            self.add(t)

    def add(self, token: int) -> None:
        i = self._pos.get(token)
        if i is None:
            i = self._pos[token] = self.n
            if i == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.ids[i] = token
            self.n += 1
        self.counts[i] += 1

    def position(self, token: int) -> int | None:
        """The token's index in ``ids`` (None if never seen)."""
        return self._pos.get(token)


@dataclass(slots=True)
class PenaltyState:
    """A row's token statistics for penalties, kept up to date as it samples (O(1) a token)."""

    output: GrowingIds  # output tokens and their counts (frequency, presence)
    seen: GrowingIds | None  # prompt + output tokens (repetition only)

    @classmethod
    def build(cls, prompt: list[int], output: list[int], repetition: bool) -> "PenaltyState":
        return cls(GrowingIds(output), GrowingIds(prompt + output) if repetition else None)

    def add(self, token: int) -> None:
        self.output.add(token)
        if self.seen is not None:
            self.seen.add(token)


@dataclass(slots=True)
class RowSamplingExtras:
    """The ragged per-row sampling data, precomputed once per request as numpy arrays."""

    min_tokens_stop_ids: np.ndarray  # EOS + stop_token_ids: banned before min_tokens
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    allowed_ids: np.ndarray | None = None
    bad_words: list[list[int]] | None = None
    penalty: PenaltyState | None = None  # built on the first step that needs it

    @classmethod
    def from_params(cls, sp: SamplingParams, eos_token_id: int | None) -> "RowSamplingExtras":
        stop_ids = list(sp.stop_token_ids or [])
        if eos_token_id is not None:
            stop_ids.append(eos_token_id)
        extras = cls(min_tokens_stop_ids=np.asarray(sorted(set(stop_ids)), dtype=np.int64))
        if sp.logit_bias:
            extras.bias_ids = np.fromiter(sp.logit_bias.keys(), dtype=np.int64)
            extras.bias_values = np.fromiter(sp.logit_bias.values(), dtype=np.float32)
        if sp.allowed_token_ids is not None:
            extras.allowed_ids = np.asarray(sp.allowed_token_ids, dtype=np.int64)
        if sp.bad_words_token_ids:
            extras.bad_words = [list(w) for w in sp.bad_words_token_ids]
        return extras


class InputBatch:
    """``num_groups > 1`` (a model with several KV-cache groups): one block table per group,
    ``block_tables[g]`` and ``group_num_blocks[g]``; group 0's are ``block_table`` and
    ``num_blocks``, the one table of every other model. ``grouped``: block ids arrive as one
    list per group (default: with several groups)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 num_groups: int = 1, grouped: bool | None = None) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_groups = num_groups
        # block ids arrive per group (the hybrid manager's protocol, also for one group)
        self.grouped = num_groups > 1 if grouped is None else grouped
        self.block_tables = [self.block_table] + [
            np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
            for _ in range(num_groups - 1)]
        self.group_num_blocks = [self.num_blocks] + [
            np.zeros(max_num_reqs, dtype=np.int64) for _ in range(num_groups - 1)]
        # Sampling columns (one entry per row).
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1 = no logprobs
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.has_bias = np.zeros(max_num_reqs, dtype=bool)
        self.has_allowed = np.zeros(max_num_reqs, dtype=bool)
        self.has_bad_words = np.zeros(max_num_reqs, dtype=bool)
        self.has_seed = np.zeros(max_num_reqs, dtype=bool)
        # Any of the above that changes logits (penalties, bias, allow-list, bad words) or
        # min_tokens: a step whose rows have none skips their per-row checks at once.
        self.has_processors = np.zeros(max_num_reqs, dtype=bool)
        # The LoRA adapter id of each row (0 = the base model).
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)
        self._columns = (
            self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
            self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
            self.frequency_penalty, self.repetition_penalty, self.min_tokens, self.num_logprobs,
            self.has_penalties, self.has_bias, self.has_allowed, self.has_bad_words,
            self.has_seed, self.has_processors, self.lora_id, *self.group_num_blocks[1:])
        self.sampling_params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []
        self.extras: list[RowSamplingExtras] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, data: NewRequestData, generator: torch.Generator | None) -> int:
        if data.req_id in self.req_id_to_row:
            self.remove_request(data.req_id)
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        self.req_ids.append(data.req_id)
        self.req_id_to_row[data.req_id] = row
        n = len(data.token_ids)
        self.token_ids[row, :n] = data.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        if not self.grouped:
            self.num_blocks[row] = 0
            self.append_block_ids(row, data.block_ids)
        else:
            self.set_group_block_ids(row, data.block_ids, (0,) * self.num_groups)
        sp = data.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.has_penalties[row] = sp.has_penalties
        self.has_bias[row] = bool(sp.logit_bias)
        self.has_allowed[row] = sp.allowed_token_ids is not None
        self.has_bad_words[row] = bool(sp.bad_words_token_ids)
        self.has_seed[row] = generator is not None
        self.has_processors[row] = bool(
            self.has_penalties[row] or self.has_bias[row] or self.has_allowed[row]
            or self.has_bad_words[row] or sp.min_tokens > 0)
        self.lora_id[row] = data.lora_id or 0
        self.sampling_params.append(sp)
        self.generators.append(generator)
        self.extras.append(RowSamplingExtras.from_params(sp, data.eos_token_id))
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def set_group_block_ids(self, row: int, block_ids: tuple[list[int], ...],
                            offsets: tuple[int, ...] | None) -> None:
        """Per KV-cache group: keep the row's first ``offsets[g]`` blocks (all: None), then
        append ``block_ids[g]``."""
        for g, ids in enumerate(block_ids):
            counts = self.group_num_blocks[g]
            start = counts[row] if offsets is None else offsets[g]
            if ids:
                self.block_tables[g][row, start:start + len(ids)] = ids
            counts[row] = start + len(ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            self._move(last, row)
        self.req_ids.pop()
        self.sampling_params.pop()
        self.generators.pop()
        self.extras.pop()

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]]

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for g in range(1, self.num_groups):
            nb = self.group_num_blocks[g][src]
            self.block_tables[g][dst, :nb] = self.block_tables[g][src, :nb]
        for arr in self._columns:
            arr[dst] = arr[src]
        rid = self.req_ids[src]
        self.req_ids[dst] = rid
        self.req_id_to_row[rid] = dst
        self.sampling_params[dst] = self.sampling_params[src]
        self.generators[dst] = self.generators[src]
        self.extras[dst] = self.extras[src]


# -- a step's inputs -----------------------------------------------------------------------
@dataclass(slots=True)
class LogitsLayout:
    """Which logits row belongs to which request: ``rows[i]`` (a batch row) owns
    ``num_logits[i]`` consecutive logits rows, the last ``num_logits[i]`` positions it
    computed; ``drafts[i]`` are its ``num_logits[i] - 1`` draft tokens."""

    rows: np.ndarray
    num_logits: np.ndarray
    drafts: list[list[int]]

    @classmethod
    def one_each(cls, rows: np.ndarray) -> "LogitsLayout":
        return cls(rows, np.ones(len(rows), dtype=np.int64), [[] for _ in range(len(rows))])

    @property
    def has_drafts(self) -> bool:
        return bool(len(self.num_logits)) and int(self.num_logits.max()) > 1

    @property
    def logits_rows(self) -> np.ndarray:
        """The batch row of every logits row."""
        return np.repeat(self.rows, self.num_logits)

    @property
    def offsets(self) -> np.ndarray:
        """Each logits row's position within its request's run (0 = the next token)."""
        starts = np.cumsum(self.num_logits) - self.num_logits
        return np.arange(int(self.num_logits.sum())) - np.repeat(starts, self.num_logits)


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
    metadata = AttentionMetadata.from_host(query_start_loc, seq_lens,
                                           b.block_table[rows, :max_blocks], slot_mapping,
                                           int(num_sched.max()), block_size)
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
