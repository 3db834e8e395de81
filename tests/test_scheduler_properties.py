"""Property-based: the token-budget scheduler and the KV cache manager under random interleavings.

Hypothesis drives ``TokenBudgetScheduler`` (small KV pools so preemption happens; both
preemption policies; fcfs/priority; lru/lfu eviction; prefix caching on/off with pinned
prefixes; small/large token budgets, chunked prefill on/off) through random sequences of
add / schedule / update / abort, with a fake runner that samples a token for every row that
reaches the end of its known tokens (random EOS, stop ids, small max_tokens). After every
operation: ``kv.check_integrity()`` plus scheduler invariants, and a KV *content* oracle: a
prefix-cache hit must hand out blocks whose KV was written for exactly that token prefix. At
the end everything is aborted and every block must be back (minus pinned ones).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.sampling import SamplingParams
from llmkit.scheduler.token_budget import TokenBudgetScheduler

EOS, STOP = 0, 3
MAX_MODEL_LEN = 16
# Prompts start with (part of) one of these, so they often share prefixes.
SHARED = [list(range(100, 112)), list(range(200, 212)), [7] * 12]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@st.composite
def configs(draw):
    bs = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(4, 12))
    caching = draw(st.sampled_from([True, True, True, False]))
    pinned = []
    if caching and draw(st.booleans()):
        n_pin_blocks = draw(st.integers(1, max(1, num_blocks // 4)))
        pinned = [SHARED[draw(st.integers(0, 2))][: n_pin_blocks * bs]]
    budget = draw(st.sampled_from([3, 8, 64]))
    chunked = True if budget < MAX_MODEL_LEN else draw(st.booleans())
    return {
        "block_size": bs,
        "num_blocks": num_blocks,
        "caching": caching,
        "eviction_policy": draw(st.sampled_from(["lru", "lfu"])),
        "pinned": pinned,
        "sched": dict(
            max_num_seqs=draw(st.integers(1, 6)),
            max_num_batched_tokens=budget,
            policy=draw(st.sampled_from(["fcfs", "priority"])),
            preemption_policy=draw(st.sampled_from(["lifo", "fewest_computed_tokens"])),
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
            num_lookahead_tokens=draw(st.sampled_from([0, 0, 1])),
        ),
    }


add_op = st.tuples(
    st.just("add"),
    st.sampled_from([0, 0, 1, 2, 3]),                   # which shared prefix (3: none)
    st.sampled_from([0, 2, 4, 5, 8, 9, 12]),            # how much of it
    st.lists(st.integers(4, 9), min_size=0, max_size=4),  # own suffix
    st.integers(1, 6),                                  # max_tokens
    st.integers(0, 2),                                  # priority
    st.booleans(),                                      # ignore_eos
    st.booleans(),                                      # stop on STOP
    st.integers(0, 1),                                  # min_tokens
)
# "step" does k half-steps: each schedules when no step is in flight, else runs the fake
# runner (sampling from `tokens`) and updates.
step_op = st.tuples(st.just("step"), st.lists(st.sampled_from([EOS, STOP, 5, 6, 8]),
                                              min_size=1, max_size=4), st.integers(1, 8))
abort_op = st.tuples(st.just("abort"), st.integers(0, 10))
# Mostly steps (each is half a step: schedule, or run + update), some arrivals, few aborts.
_OPS = {"step": step_op, "add": add_op, "abort": abort_op}
op_strategy = st.sampled_from(["step"] * 6 + ["add"] * 3 + ["abort"]).flatmap(_OPS.__getitem__)
ops_strategy = st.lists(op_strategy, min_size=25, max_size=80)  # ~50 ops on average


class Harness:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.bs = cfg["block_size"]
        self.kv = KVCacheManager(cfg["num_blocks"], self.bs, enable_prefix_caching=cfg["caching"],
                                 max_model_len=MAX_MODEL_LEN,
                                 eviction_policy=cfg["eviction_policy"],
                                 pinned_prefixes=cfg["pinned"])
        self.sched_cfg = SchedulerConfig(**cfg["sched"])
        self.sched = TokenBudgetScheduler(self.sched_cfg, self.kv, max_model_len=MAX_MODEL_LEN,
                                          eos_token_id=EOS, clock=FakeClock())
        self.pending = None  # the SchedulerOutput of the step in flight
        self.counter = 0
        self.ended: set[str] = set()
        self.aborted_mid_step = 0
        # block id -> the token prefix its KV was last written for (complete blocks only)
        self.content: dict[int, tuple[int, ...]] = {}

    # -- operations ------------------------------------------------------------------------
    def add(self, which, take, suffix, max_tokens, priority, ignore_eos, stop, min_tokens):
        prompt = (SHARED[which][:take] if which < 3 else []) + suffix or [1]
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                stop_token_ids=[STOP] if stop else [], min_tokens=min_tokens)
        self.sched.add_request(Request(f"r{self.counter}", prompt, params, priority=priority))

    def step(self, tokens, k=1):
        for i in range(k):
            if self.pending is None:
                self.pending = self.schedule()
            else:
                self.update(tokens)
            if i < k - 1:
                self.check()

    def abort(self, idx):
        live = sorted(self.sched.requests)
        if live and idx < len(live):
            rid = live[idx]
        else:  # an unknown or already finished id is ignored
            rid = sorted(self.ended)[idx % len(self.ended)] if self.ended else "nope"
        outs = self.sched.abort([rid])
        assert all(o.finish_reason == "abort" for o in outs)
        if outs:
            self.ended.add(rid)
            self.aborted_mid_step += self.pending is not None

    def schedule(self):
        sched, kv, bs = self.sched, self.kv, self.bs
        before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        out = sched.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= self.sched_cfg.max_num_batched_tokens
        assert len(sched.running) <= self.sched_cfg.max_num_seqs
        assert not (out.preempted_req_ids & set(out.num_scheduled_tokens))
        for rid in out.preempted_req_ids:
            assert kv.get_block_ids(rid) == []
        # Newly allocated blocks hold stale KV until written.
        for nr in out.scheduled_new_reqs:
            assert nr.block_ids == kv.get_block_ids(nr.req_id)
            for bid in nr.block_ids[nr.num_computed_tokens // bs:]:
                self.content.pop(bid, None)
        for rid, new_ids in zip(out.scheduled_cached_reqs.req_ids,
                                out.scheduled_cached_reqs.new_block_ids):
            assert kv.get_block_ids(rid)[len(kv.get_block_ids(rid)) - len(new_ids):] == new_ids
            for bid in new_ids:
                self.content.pop(bid, None)
        # The step writes KV for tokens [start, start + n) of each scheduled request.
        starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids,
                          out.scheduled_cached_reqs.num_computed_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            start, end = starts[rid], starts[rid] + n
            assert n >= 1 and end <= req.num_tokens, (rid, start, n, req.num_tokens)
            assert req.num_computed_tokens == end
            if rid in before and rid not in {nr.req_id for nr in out.scheduled_new_reqs}:
                assert before[rid] == start
            ids = kv.get_block_ids(rid)
            assert len(ids) * bs >= end, f"{rid}: {len(ids)} blocks for {end} tokens"
            for j in range(start // bs, end // bs):
                self.content[ids[j]] = tuple(req.all_token_ids[: (j + 1) * bs])
        # A prefix-cache hit must hold exactly the KV of that prefix.
        for nr in out.scheduled_new_reqs:
            assert nr.num_computed_tokens % bs == 0
            if not self.cfg["caching"]:
                assert nr.num_computed_tokens == 0
            for j in range(nr.num_computed_tokens // bs):
                assert self.content.get(nr.block_ids[j]) == tuple(nr.token_ids[: (j + 1) * bs]), \
                    f"{nr.req_id}: hit block {nr.block_ids[j]} holds other KV"
        return out

    def update(self, tokens):
        out, self.pending = self.pending, None
        sampled = []
        for i, rid in enumerate(out.num_scheduled_tokens):
            req = self.sched.requests.get(rid)
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([tokens[i % len(tokens)]] if done else [])
        outs = self.sched.update_from_output(
            out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        for o in outs:
            if o.finished:
                self.ended.add(o.request_id)
                assert o.request_id not in self.sched.requests

    # -- invariants --------------------------------------------------------------------------
    def check(self):
        kv, sched = self.kv, self.sched
        kv.check_integrity()
        running = {r.request_id for r in sched.running}
        assert set(kv.req_to_blocks) <= running, "a request that is not running holds blocks"
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert len(kv.get_block_ids(r.request_id)) * self.bs >= r.num_computed_tokens
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.get_block_ids(r.request_id) == []
        assert len(sched.waiting) + len(sched.running) == len(sched.requests)
        held = {b for ids in (kv.get_block_ids(r) for r in running) for b in ids}
        idle_pinned = sum(1 for b in kv.block_pool.blocks if b.pinned and b.ref_cnt == 0)
        assert kv.num_free_blocks == kv.num_blocks - len(held) - idle_pinned
        s = kv.prefix_cache_stats
        assert 0 <= s.hits <= s.queries

    def all_fit(self) -> bool:
        """Whether a request of max_model_len tokens fits the pool on its own."""
        pinnable = len(self.kv.pinned_hashes)
        return -(-MAX_MODEL_LEN // self.bs) <= self.cfg["num_blocks"] - pinnable


def run_ops(cfg, ops, drain: bool) -> Harness:
    h = Harness(cfg)
    for op in ops:
        getattr(h, op[0])(*op[1:])
        h.check()
    if drain and h.all_fit():
        # Liveness: with no more arrivals, every request finishes.
        for _ in range(2000):
            if not h.sched.has_unfinished_requests() and h.pending is None:
                break
            h.step([5])
            h.check()
        else:
            raise AssertionError(f"not drained: {h.sched.requests}")
    # What the example exercised (pytest --hypothesis-show-statistics).
    stats = h.kv.prefix_cache_stats
    for name, happened in [("preemption", h.sched.num_preemptions_total), ("hit", stats.hits),
                           ("eviction", stats.evictions), ("pinned", h.kv.num_pinned_blocks),
                           ("abort mid-step", h.aborted_mid_step)]:
        event(f"{name}: {'yes' if happened else 'no'}")
    # Abort everything (a step may be in flight): every block comes back, pinned ones excepted.
    h.sched.abort(list(h.sched.requests))
    h.check()
    if h.pending is not None:
        h.update([5])
        h.check()
    h.sched.schedule()
    kv = h.kv
    kv.check_integrity()
    assert not h.sched.has_unfinished_requests() and kv.req_to_blocks == {}
    assert kv.num_free_blocks == kv.num_blocks - kv.num_pinned_blocks
    assert kv.usage == pytest.approx(kv.num_pinned_blocks / kv.num_blocks)
    assert kv.num_pinned_blocks <= len(kv.pinned_hashes)
    return h


# No "explain" phase: tracing ~60-op examples takes minutes; shrinking alone takes seconds.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]


@settings(max_examples=300, deadline=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), ops=ops_strategy)
def test_random_interleavings_keep_kv_integrity(cfg, ops):
    run_ops(cfg, ops, drain=False)


@settings(max_examples=100, deadline=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), ops=ops_strategy)
def test_random_interleavings_then_drain(cfg, ops):
    run_ops(cfg, ops, drain=True)


# -- found by the drain property: a request that outgrows the whole pool used to livelock --
def test_request_larger_than_the_pool_is_refused_not_preempted_forever():
    """4 blocks of 4 slots (16 tokens) and a request that grows to 24 tokens, chunked prefill
    (budget 8), prefix caching off. It used to be preempted as its own victim and re-admitted
    chunk by chunk forever; alone and out of blocks, it now ends capped by KV capacity."""
    kv = KVCacheManager(4, 4, enable_prefix_caching=False, max_model_len=64)
    sched = TokenBudgetScheduler(SchedulerConfig(max_num_batched_tokens=8), kv, max_model_len=64,
                                 eos_token_id=EOS, clock=FakeClock())
    sched.add_request(Request("a", list(range(10, 24)),
                              SamplingParams(max_tokens=10, ignore_eos=True)))
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in out.num_scheduled_tokens]
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
    assert not sched.has_unfinished_requests(), \
        f"still running after 200 steps, {sched.num_preemptions_total} preemptions"
    assert kv.num_free_blocks == kv.num_blocks
