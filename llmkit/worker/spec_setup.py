"""Adaptive K's inputs, measured once the KV cache exists: the step costs of this model on
this machine (or the calibrated ridge from the config)."""
from __future__ import annotations

import logging

from llmkit.config.schema import SpeculativeConfig
from llmkit.platforms.base import Platform, ridge_from_timings
from llmkit.spec_decode.adaptive import DraftLengthPolicy, StepCosts
from llmkit.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def adaptive_length_policy(spec: SpeculativeConfig, platform: Platform, runner: ModelRunner,
                           max_num_seqs: int) -> DraftLengthPolicy:
    """``speculative.adaptive`` with ``ridge_tokens`` given: the ridge rule; without it: the
    decode step's cost by rows, timed here (``Platform.measure_step_costs``), and the
    expected-throughput rule. ``disable_by_batch_size`` either way."""
    if not spec.adaptive or spec.ridge_tokens is not None:
        return DraftLengthPolicy(spec.adaptive, spec.ridge_tokens, spec.disable_by_batch_size)
    k = spec.num_speculative_tokens
    timings = platform.measure_step_costs(runner.time_decode_step, fine_upto=k + 1,
                                          max_rows=max_num_seqs * (1 + k))
    ridge = ridge_from_timings(timings)
    t1 = timings[1]
    logger.info("speculative.adaptive: a decode step of n rows costs (n: x one row) %s on "
                "this machine (measured; compute-bound from ~%d tokens); K per step maximises "
                "the expected tokens per second",
                ", ".join(f"{n}: {t / t1:.2f}" for n, t in sorted(timings.items())), ridge)
    return DraftLengthPolicy(True, ridge, spec.disable_by_batch_size,
                             step_costs=StepCosts(timings))
