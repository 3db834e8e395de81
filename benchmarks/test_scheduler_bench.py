"""Whole scheduler steps on the shared trace (no model): schedule() + update_from_output().

Trace: `sched_trace.make_trace(seed=0)` (vendored from ../shared/bench), block size 16, 4096
blocks, max_num_seqs=128, max_num_batched_tokens=4096, all requests added at once; the fake
runner samples one token for every request whose step reaches the end of its known tokens.
Run: `pytest benchmarks/test_scheduler_bench.py --benchmark-only -s`.

Hit rate = prefix-cache hit tokens / tokens looked up, counted at every admission (re-admissions
after preemption included; a waiting request that is looked up but gets no blocks is counted
only when it is admitted), as vLLM's v1 scheduler counts. Under the default policies it equals
vLLM 0.32's on this trace, step for step, for the same number of allocatable blocks: see
``VLLM_FIGURES`` (``sched_trace_run.py``), measured with ``benchmarks/vllm_sched_reference.py``.
"""
from __future__ import annotations

import pytest

from sched_trace_run import NUM_BLOCKS, VLLM_FIGURES, run_trace, vllm_parity

@pytest.mark.parametrize("num_blocks", sorted(VLLM_FIGURES))
def test_trace_matches_vllm(num_blocks):
    """Default policies: the same admissions, hits, preemptions and steps as vLLM."""
    assert vllm_parity(run_trace(num_blocks=num_blocks), num_blocks) == {}


@pytest.mark.benchmark(group="scheduler")
def test_scheduler_step_on_trace(benchmark):
    result = benchmark.pedantic(run_trace, rounds=3, iterations=1)
    benchmark.extra_info.update(result)
    print("\nscheduler trace:", {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in result.items()})
    assert vllm_parity(result, NUM_BLOCKS) == {}
