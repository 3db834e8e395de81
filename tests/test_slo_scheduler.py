"""scheduler=slo without a model: a fake cost model (10 ms a step + 1 ms a token) and the
scheduler driver. Each test checks one decision against what the cost model says."""
from __future__ import annotations

from helpers.slo_clock import Clock
from helpers.slo_clock import linear_step_time as step_time

import pytest
from helpers.scheduler_driver import fake_run, req

from llmkit.config.errors import ConfigError
from llmkit.config.schema import SchedulerConfig, SloConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import is_slo_rejection
from llmkit.request import Request, RequestStatus
from llmkit.sampling import SamplingParams
from llmkit.scheduler import SCHEDULERS, TokenBudgetScheduler
from llmkit.scheduler.slo import SloScheduler




def make(slo: SloConfig, admission: str = "off", *, budget: int = 512, clock=None,
         num_blocks: int = 400, **cfg) -> SloScheduler:
    config = SchedulerConfig(name="slo", max_num_batched_tokens=budget, slo_admission=admission,
                             **cfg)
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=False, max_model_len=4096)
    return SloScheduler(config, kv, max_model_len=4096, slo=slo, step_time=step_time,
                        clock=clock or Clock())


def work_of(sched, out) -> list[tuple[int, int, bool]]:
    """The step ``out`` as the cost model sees it (before its tokens count as computed)."""
    work = []
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests[rid]
        start = r.num_computed_tokens - n  # schedule() already counted them
        work.append((n, start + n, start + n >= r.num_tokens))
    return work


def test_registered_by_name():
    assert SCHEDULERS.resolve("slo", None) is SloScheduler


def test_step_stays_inside_tpot_while_requests_decode():
    """Four requests decode while a long prompt waits: every step is priced within TPOT (50 ms:
    at most 40 tokens at 1 ms + 10 ms), and the prompt is filled into the slack in chunks."""
    sched = make(SloConfig(tpot_ms=50))
    for i in range(4):
        sched.add_request(req(f"d{i}", 8, max_tokens=30))
    fake_run(sched, sched.schedule())  # the short prompts: one step, no one decoding yet
    sched.add_request(req("long", 300, max_tokens=2))
    steps_with_decodes = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        work = work_of(sched, out)
        decoding = [w for w in work if w[0] == 1 and w[2]]
        if decoding:
            steps_with_decodes += 1
            assert step_time(work) <= 0.050 + 1e-9, work
            assert out.total_num_scheduled_tokens <= 40
        fake_run(sched, out)
    assert steps_with_decodes >= 8  # the long prompt took several chunks beside the decodes


def test_token_budget_scheduler_would_break_tpot():
    """The reference: the token-budget scheduler with the same budget prices a step far over
    50 ms (so the test above measures the SLO scheduler's sizing, not the workload)."""
    kv = KVCacheManager(400, 16, enable_prefix_caching=False, max_model_len=4096)
    sched = TokenBudgetScheduler(SchedulerConfig(max_num_batched_tokens=512), kv,
                                 max_model_len=4096)
    for i in range(4):
        sched.add_request(req(f"d{i}", 8, max_tokens=30))
    fake_run(sched, sched.schedule())
    sched.add_request(req("long", 300, max_tokens=2))
    out = sched.schedule()
    assert step_time(work_of(sched, out)) > 0.050


def test_without_decodes_the_whole_budget_prefills():
    sched = make(SloConfig(tpot_ms=50), budget=256)
    sched.add_request(req("a", 300, max_tokens=2))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 256


def test_waiting_requests_go_by_ttft_deadline():
    """Added late but arrived first: its deadline is earliest, so it is admitted first (the
    token-budget scheduler admits in the order requests were added)."""
    clock = Clock()
    sched = make(SloConfig(ttft_ms=1000), budget=64, clock=clock, max_num_seqs=1)
    late = Request("late", list(range(100, 132)), SamplingParams(max_tokens=2), arrival_time=5.0)
    early = Request("early", list(range(200, 232)), SamplingParams(max_tokens=2),
                    arrival_time=1.0)
    clock.t = 5.0
    sched.add_request(late)
    sched.add_request(early)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["early"]


def test_priority_policy_orders_before_deadline():
    clock = Clock()
    sched = make(SloConfig(ttft_ms=1000), budget=64, clock=clock, max_num_seqs=1,
                 policy="priority")
    a = Request("a", list(range(100, 132)), SamplingParams(max_tokens=2), arrival_time=1.0,
                priority=5)
    b = Request("b", list(range(200, 232)), SamplingParams(max_tokens=2), arrival_time=2.0,
                priority=0)
    sched.add_request(a)
    sched.add_request(b)
    assert list(sched.schedule().num_scheduled_tokens) == ["b"]


def _burst(sched, n: int = 6, prompt: int = 128) -> None:
    for i in range(n):
        sched.add_request(Request(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + prompt)),
                                  SamplingParams(max_tokens=3), arrival_time=0.0))


def test_reject_ends_requests_predicted_to_miss_ttft():
    """A 128-token step takes 138 ms; TTFT 300 ms lets two prompts' prefills finish in time
    (1 and 2 steps), not the third: the rest are rejected, with the reason, and counted."""
    sched = make(SloConfig(ttft_ms=300), "reject", budget=128)
    _burst(sched)
    out = sched.schedule()
    outs = fake_run(sched, out)
    rejected = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.request_id for o in rejected) == ["r2", "r3", "r4", "r5"]
    for o in rejected:
        assert is_slo_rejection(o.finish_reason, o.stop_reason), o
        assert "predicted TTFT" in o.stop_reason and "slo.ttft_ms=300" in o.stop_reason
        assert o.new_token_ids == []
    assert sched.stats().slo_rejected_total == 4
    while sched.has_unfinished_requests():
        fake_run(sched, sched.schedule())
    assert sched.kv.usage == 0.0


def test_defer_serves_everyone_but_late_ones_last():
    sched = make(SloConfig(ttft_ms=300), "defer", budget=128, max_num_seqs=8)
    _burst(sched)
    first_token: dict[str, int] = {}
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for o in fake_run(sched, out):
            if o.new_token_ids:
                first_token.setdefault(o.request_id, step)
            assert o.finish_reason in (None, "length")
        step += 1
    assert sched.stats().slo_deferred_total == 4
    assert set(first_token) == {f"r{i}" for i in range(6)}  # every one served
    assert max(first_token["r0"], first_token["r1"]) < min(
        first_token[f"r{i}"] for i in range(2, 6))


def test_admission_off_rejects_and_defers_nothing():
    sched = make(SloConfig(ttft_ms=300), "off", budget=128)
    _burst(sched)
    while sched.has_unfinished_requests():
        for o in fake_run(sched, sched.schedule()):
            assert o.finish_reason in (None, "length")
    stats = sched.stats()
    assert stats.slo_rejected_total == stats.slo_deferred_total == 0


def test_needs_an_objective_and_a_step_time():
    kv = KVCacheManager(10, 16, enable_prefix_caching=False, max_model_len=256)
    with pytest.raises(ConfigError, match="slo.tpot_ms"):
        SloScheduler(SchedulerConfig(name="slo"), kv, max_model_len=256, slo=SloConfig(),
                     step_time=step_time)
    with pytest.raises(ValueError, match="step_time"):
        SloScheduler(SchedulerConfig(name="slo"), kv, max_model_len=256,
                     slo=SloConfig(tpot_ms=50))


def test_rejected_status_is_an_abort():
    assert RequestStatus.FINISHED_REJECTED.finished
    assert RequestStatus.FINISHED_REJECTED.finish_reason == "abort"


def test_step_time_is_asked_with_the_streamed_rate():
    """Four requests decode, a step every 100 ms: the cost model is asked with ~40 tokens/s
    streamed (the front end's share of the cores depends on it)."""
    clock = Clock()
    seen: list[float] = []

    def priced(work, stream_rate=0.0):
        seen.append(stream_rate)
        return step_time(work)

    config = SchedulerConfig(name="slo", max_num_batched_tokens=512)
    kv = KVCacheManager(100, 16, enable_prefix_caching=False, max_model_len=4096)
    sched = SloScheduler(config, kv, max_model_len=4096, slo=SloConfig(tpot_ms=50),
                         step_time=priced, clock=clock)
    for i in range(4):
        sched.add_request(req(f"d{i}", 8, max_tokens=40))
    for _ in range(30):
        fake_run(sched, sched.schedule())
        clock.t += 0.1
    assert seen[-1] == pytest.approx(40.0, rel=0.05)
