"""``StepSummaryPublisher`` alone (fake core, scheduler and KV manager, a fake clock): the rate
limit, the counted steps, the idle flush, the chained step trace, snapshots with the KV check;
and ``EngineStepFeed``'s ring, subscribers and queries."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from llmkit.engine.step_feed import EngineStepFeed
from llmkit.engine.step_summary import (EngineSnapshotQuery, EngineStepSummary,
                                        StepSummaryPublisher)
from llmkit.request import RequestStatus
from llmkit.scheduler.base import CachedRequestData, SchedulerOutput, SchedulerStats


class FakeKV:
    num_blocks = 100
    num_free_blocks = 90
    num_prefix_cached_blocks = 7
    broken = False

    def get_block_ids(self, rid):
        return [1, 2, 3] if rid == "a" else []

    def check_integrity(self):
        if self.broken:
            raise AssertionError("block 3: ref_cnt=2 but 1 live requests hold it")


class FakeScheduler:
    def __init__(self):
        self.requests = {
            "b": SimpleNamespace(request_id="b", status=RequestStatus.WAITING, arrival_index=1,
                                 num_prompt_tokens=5, num_computed_tokens=0,
                                 num_output_tokens=0),
            "a": SimpleNamespace(request_id="a", status=RequestStatus.RUNNING, arrival_index=0,
                                 num_prompt_tokens=40, num_computed_tokens=41,
                                 num_output_tokens=2),
        }

    def get_request(self, rid):
        return self.requests.get(rid)

    def stats(self):
        return SchedulerStats(num_running=1, num_waiting=1, kv_usage=0.1,
                              num_preemptions_total=3, prefix_cache_queries=80,
                              prefix_cache_hits=32)


class Trace:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a: self.calls.append(name)


def decode_step() -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[],
                           scheduled_cached_reqs=CachedRequestData(req_ids=["a"],
                                                                   num_computed_tokens=[41]),
                           num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                           finished_req_ids=set(), preempted_req_ids=set())


def make(max_per_s=10.0):
    now = [0.0]
    sent = []
    trace = Trace()
    core = SimpleNamespace(scheduler=FakeScheduler(), kv_cache_manager=FakeKV(),
                           step_trace=trace)
    pub = StepSummaryPublisher(core, sent.append, max_per_s, clock=lambda: now[0]).install()
    assert core.step_trace is pub

    def step(dt=1 / 64):
        pub.begin_step()
        pub.scheduled(decode_step(), core.scheduler)
        pub.executed()
        now[0] += dt
        pub.end_step(core.scheduler)
    return pub, sent, trace, step, core


def test_rate_limit_counts_the_steps_it_does_not_send():
    pub, sent, trace, step, _ = make(max_per_s=8.0)
    for _ in range(27):  # steps of 1/64 s, at most one summary every 1/8 s
        step()
    assert [s.step for s in sent] == [1, 9, 17, 25]
    assert [s.steps_skipped for s in sent] == [0, 7, 7, 7]
    assert sent[1].tokens_skipped == 7 and sent[1].total_scheduled_tokens == 9
    s = sent[0]
    assert (s.num_decode_tokens, s.num_decode_reqs, s.num_prefill_tokens) == (1, 1, 0)
    assert s.step_ms > 0 and s.num_held_blocks == 10 and s.num_cached_blocks == 7
    assert (s.prefix_cache_hits, s.prefix_cache_queries, s.num_preemptions_total) == (32, 80, 3)
    # running first, then waiting; the blocks each holds
    assert [(r.request_id, r.status, r.num_blocks) for r in s.requests] == \
        [("a", "running", 3), ("b", "waiting", 0)]
    # the core's own trace still sees every hook of every step
    assert trace.calls.count("end_step") == 27 and trace.calls.count("scheduled") == 27
    pub.flush()  # idle: the 2 steps not sent are accounted for
    assert sent[-1].steps_skipped == 2 and sent[-1].step_ms == 0.0 and sent[-1].step == 27
    n = len(sent)
    pub.flush()  # nothing changed since: nothing sent
    assert len(sent) == n
    pub.state_changed()
    pub.flush()
    assert len(sent) == n + 1
    pub.close()
    assert trace.calls[-1] == "close"


def test_snapshot_with_kv_check_and_wire_format():
    pub, sent, _, step, core = make(max_per_s=0)  # publishing off: snapshots still answer
    assert not pub.enabled
    step()
    assert sent == []
    snap = pub.snapshot(EngineSnapshotQuery(7, check_kv=True))
    assert snap.query_id == 7 and snap.kv_checked and snap.kv_integrity_error is None
    core.kv_cache_manager.broken = True
    bad = pub.snapshot(EngineSnapshotQuery(8, check_kv=True))
    assert "ref_cnt=2" in bad.kv_integrity_error
    wire = msgspec.msgpack.encode(bad)
    assert msgspec.msgpack.decode(wire, type=EngineStepSummary) == bad


def test_feed_ring_subscribers_and_queries():
    async def run():
        feed = EngineStepFeed(history=3, subscriber_queue=2)
        q = feed.subscribe()
        for i in range(5):
            feed.publish(EngineStepSummary(step=i, time=0.0))
        assert [s.step for s in feed.recent] == [2, 3, 4] and feed.latest.step == 4
        assert [q.get_nowait().step, q.get_nowait().step] == [3, 4]  # a slow reader drops
        qid, fut = feed.new_query(asyncio.get_running_loop())
        feed.publish(EngineStepSummary(step=9, time=0.0, query_id=qid))
        assert (await fut).step == 9 and feed.latest.step == 4  # answers skip the ring
        qid, fut = feed.new_query(asyncio.get_running_loop())
        err = RuntimeError("dead")
        feed.fail(err)
        assert fut.exception() is err and q.get_nowait() is err
        feed.unsubscribe(q)
        assert feed.num_subscribers == 0
    asyncio.run(run())
