"""Whole scheduler steps on the shared trace (no model): schedule() + update_from_output().

Trace: `sched_trace.make_trace(seed=0)` (vendored from ../shared/bench), block size 16, 4096
blocks, max_num_seqs=128, max_num_batched_tokens=4096, all requests added at once; the fake
runner samples one token for every request whose step reaches the end of its known tokens.
Run: `pytest benchmarks/test_scheduler_bench.py --benchmark-only -s`.
"""
from __future__ import annotations

import statistics
import time

import pytest

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling import SamplingParams
from llmkit.scheduler.token_budget import TokenBudgetScheduler
from sched_trace import make_trace

TRACE = make_trace(seed=0)


def run_trace(scheduler_cfg: SchedulerConfig | None = None) -> dict:
    kv = KVCacheManager(4096, 16, enable_prefix_caching=True, max_model_len=4096)
    cfg = scheduler_cfg or SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096)
    sched = TokenBudgetScheduler(cfg, kv, max_model_len=4096, eos_token_id=None)
    for rid, prompt, max_tokens in TRACE:
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True)))
    step_times, schedule_times = [], []
    clock = time.perf_counter
    requests = sched.requests
    while sched.has_unfinished_requests():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = requests[rid]
            sampled.append([5] if r.num_computed_tokens >= r.num_tokens else [])
        runner_out = ModelRunnerOutput(ids, sampled)
        t2 = clock()
        sched.update_from_output(out, runner_out)
        t3 = clock()
        step_times.append((t1 - t0) + (t3 - t2))
        schedule_times.append(t1 - t0)
    assert kv.num_free_blocks == kv.num_blocks
    stats = kv.prefix_cache_stats
    return {
        "steps": len(step_times),
        "step_mean_ms": 1e3 * statistics.fmean(step_times),
        "step_p50_ms": 1e3 * statistics.median(step_times),
        "schedule_mean_ms": 1e3 * statistics.fmean(schedule_times),
        "hit_rate": stats.hits / max(stats.queries, 1),
        "preemptions": sched.num_preemptions_total,
    }


@pytest.mark.benchmark(group="scheduler")
def test_scheduler_step_on_trace(benchmark):
    result = benchmark.pedantic(run_trace, rounds=3, iterations=1)
    benchmark.extra_info.update(result)
    print("\nscheduler trace:", {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in result.items()})
