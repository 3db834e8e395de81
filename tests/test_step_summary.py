"""``StepSummaryPublisher`` alone (fake core, scheduler and KV manager, a fake clock): the rate
limit, the counted steps, the idle flush, snapshots with the KV check;
and ``EngineStepFeed``'s ring, subscribers and queries."""
from __future__ import annotations

import asyncio

import msgspec

from llmkit.engine.observe.step_summary import (EngineSnapshotQuery, EngineStepFeed,
                                                EngineStepSummary, StepSummaryPublisher)
from llmkit.engine.observe.observer import BatchSplit, KVState, RequestState, StepEvent
from llmkit.outputs import ModelRunnerOutput
from llmkit.scheduler.base import CachedRequestData, SchedulerOutput, SchedulerStats


class FakeCore:
    """The engine core's public accessors a publisher reads."""

    def __init__(self):
        self.observers = []
        self.broken = False

    def add_step_observer(self, observer):
        self.observers.append(observer)

    def stats(self):
        return SchedulerStats(num_running=1, num_waiting=1, kv_usage=0.1,
                              num_preemptions_total=3, prefix_cache_queries=80,
                              prefix_cache_hits=32)

    def kv_state(self):
        return KVState(num_blocks=100, num_free_blocks=90, num_prefix_cached_blocks=7)

    def request_states(self):
        return [RequestState("a", "running", 40, 41, 2, 3, 0),
                RequestState("b", "waiting", 5, 0, 0, 0, 1)]

    def check_kv_integrity(self):
        if self.broken:
            raise AssertionError("block 3: ref_cnt=2 but 1 live requests hold it")


def decode_step() -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[],
                           scheduled_cached_reqs=CachedRequestData(req_ids=["a"],
                                                                   num_computed_tokens=[41]),
                           num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                           finished_req_ids=set(), preempted_req_ids=set())


def make(max_per_s=10.0):
    now = [0.0]
    sent = []
    core = FakeCore()
    pub = StepSummaryPublisher(core, sent.append, max_per_s, clock=lambda: now[0]).install()
    assert core.observers == [pub]

    def step(dt=1 / 64):
        now[0] += dt
        pub.on_step(StepEvent(step=0, start_s=now[0] - dt, schedule_s=0.0, execute_s=dt,
                              update_s=0.0, scheduler_output=decode_step(),
                              runner_output=ModelRunnerOutput(req_ids=["a"],
                                                              sampled_token_ids=[[5]]),
                              outputs=[], stats=core.stats(),
                              split=BatchSplit(decode_reqs=1, decode_tokens=1,
                                               decode_context=42)))
    return pub, sent, step, core


def test_rate_limit_counts_the_steps_it_does_not_send():
    pub, sent, step, _ = make(max_per_s=8.0)
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
    pub.flush()  # idle: the 2 steps not sent are accounted for
    assert sent[-1].steps_skipped == 2 and sent[-1].step_ms == 0.0 and sent[-1].step == 27
    n = len(sent)
    pub.flush()  # nothing changed since: nothing sent
    assert len(sent) == n
    pub.state_changed()
    pub.flush()
    assert len(sent) == n + 1


def test_snapshot_with_kv_check_and_wire_format():
    pub, sent, step, core = make(max_per_s=0)  # publishing off: snapshots still answer
    assert not pub.enabled
    step()
    assert sent == []
    snap = pub.snapshot(EngineSnapshotQuery(7, check_kv=True))
    assert snap.query_id == 7 and snap.kv_checked and snap.kv_integrity_error is None
    core.broken = True
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
