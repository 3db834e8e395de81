"""Adaptive K's inputs, measured once the KV cache exists: what a decode step of n rows costs
this model on this machine (or the calibrated ridge from the config)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.config.schema import SpeculativeConfig
from llmkit.platforms.base import Platform, ridge_from_timings
from llmkit.spec_decode.adaptive import DraftLengthPolicy, StepCosts
from llmkit.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def adaptive_length_policy(spec: SpeculativeConfig, platform: Platform,
                           time_step: Callable[[int], float],
                           max_num_seqs: int) -> DraftLengthPolicy:
    """``speculative.adaptive`` with ``ridge_tokens`` given: the ridge rule; without it: the
    decode step's cost by rows, timed here with ``time_step(rows) -> seconds``
    (``Platform.measure_step_costs``; under tensor parallel every rank must get the same
    figures), and the expected-throughput rule. ``disable_by_batch_size`` either way."""
    if not spec.adaptive or spec.ridge_tokens is not None:
        return DraftLengthPolicy(spec.adaptive, spec.ridge_tokens, spec.disable_by_batch_size)
    k = spec.num_speculative_tokens
    timings = platform.measure_step_costs(time_step, fine_upto=k + 1,
                                          max_rows=max_num_seqs * (1 + k))
    ridge = ridge_from_timings(timings)
    t1 = timings[1]
    logger.info("speculative.adaptive: a decode step of n rows costs (n: x one row) %s on "
                "this machine (measured; compute-bound from ~%d tokens); K per step maximises "
                "the expected tokens per second",
                ", ".join(f"{n}: {t / t1:.2f}" for n, t in sorted(timings.items())), ridge)
    return DraftLengthPolicy(True, ridge, spec.disable_by_batch_size,
                             step_costs=StepCosts(timings))


@torch.inference_mode()
def time_decode_step(runner: ModelRunner, num_rows: int, context_len: int = 256) -> float:
    """Seconds of one decode step of ``num_rows`` rows over ``context_len`` tokens of KV
    each, with a logits row per row (what a verify step of drafts costs: each drafted
    token is a decode row), through the step graphs when they cover it, as real steps
    run. Writes no KV (slots -1) and reads the first blocks of the pool whatever they
    hold: for timing only, at start-up."""
    n = num_rows
    width = runner.batch.block_table.shape[1]
    context_len = min(context_len, runner.max_model_len)
    blocks = max(1, min(-(-context_len // runner.block_size), runner.num_kv_blocks, width))
    context_len = min(context_len, blocks * runner.block_size)
    block_table = torch.arange(blocks, dtype=torch.int32).repeat(n, 1)
    seq_lens = torch.full((n,), context_len, dtype=torch.int32)
    slots = torch.full((n,), -1, dtype=torch.int64)
    input_ids = torch.zeros(n, dtype=torch.int64, device=runner.device)
    positions = torch.full((n,), context_len - 1, dtype=torch.int64, device=runner.device)
    t0 = time.perf_counter()
    if runner.step_graphs is not None and runner.step_graphs.covers(n):
        table = torch.zeros((n, width), dtype=torch.int32)
        table[:, :blocks] = block_table
        hidden = runner.step_graphs.run(input_ids, positions, slots.to(runner.device),
                                        table.to(runner.device), seq_lens.to(runner.device))
    else:
        query_start_loc = np.arange(n + 1)
        metadata = runner.attn_backend.build_metadata(AttentionMetadata(
            num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=context_len,
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=seq_lens, block_table=block_table, slot_mapping=slots,
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=[context_len] * n,
            block_size=runner.block_size))
        hidden = runner.model(input_ids, positions, runner.kv_caches, metadata)
    runner.model.compute_logits(hidden).cpu()
    return time.perf_counter() - t0

