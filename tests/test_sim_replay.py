"""The simulation loop: the real engine core, scheduler and KV cache manager on a virtual
clock, replaying bench workloads."""
from __future__ import annotations

import pytest

from llmkit.cost_model.step_cost import StepCost
from llmkit.tools.bench.datasets import WorkloadRequest, build_workload
from llmkit.tools.bench.metrics import summarize
from llmkit.tools.sim.replay import build_sim_engine, replay, run_sim
from llmkit.tools.sim.virtual_clock import VirtualClock

from helpers.sim_config import cfg_of


def strip_wall(result: dict) -> dict:
    out = dict(result)
    out["sim"] = {k: v for k, v in result["sim"].items() if k != "wall_s"}
    return out


# --------------------------------------------------------------------------- the same classes

def test_sim_uses_the_real_engine_scheduler_and_kv_manager_classes():
    from llmkit.engine.loop.core import EngineCore
    from llmkit.executor import EXECUTORS
    from llmkit.kv_cache import KV_CACHE_MANAGERS
    from llmkit.kv_cache.manager import KVCacheManager
    from llmkit.scheduler import SCHEDULERS
    from llmkit.scheduler.token_budget import TokenBudgetScheduler
    from llmkit.tools.sim.executor import SimExecutor

    cfg = cfg_of()
    core, executor, clock = build_sim_engine(cfg)
    assert type(core) is EngineCore
    assert type(core.scheduler) is TokenBudgetScheduler
    assert type(core.scheduler) is SCHEDULERS.get(cfg.engine.scheduler.name)
    assert type(core.kv_cache_manager) is KVCacheManager
    assert type(core.kv_cache_manager) is KV_CACHE_MANAGERS.get(cfg.engine.kv_cache.name)
    assert core.scheduler.kv is core.kv_cache_manager
    assert type(executor) is SimExecutor and EXECUTORS.get("sim") is SimExecutor
    assert core.executor is executor and executor.clock is clock
    assert core.scheduler.clock is clock  # the scheduler's timestamps are virtual


def test_sim_executor_registers_through_the_entry_point_group():
    """executor/ imports nothing of tools/sim/: ``sim`` comes from pyproject.toml's
    ``llmkit.executor`` entry points (a stale install needs ``pip install -e .`` again)."""
    from importlib.metadata import entry_points

    from llmkit.executor import EXECUTORS
    from llmkit.tools.sim.executor import SimExecutor

    (ep,) = [e for e in entry_points(group="llmkit.executor") if e.name == "sim"]
    assert ep.load() is SimExecutor and EXECUTORS.get("sim") is SimExecutor


def test_no_scheduler_or_kv_manager_is_reimplemented_in_llmkit_sim():
    import importlib
    import inspect
    import pkgutil

    import llmkit.tools.sim
    from llmkit.kv_cache.base import KVCacheManagerBase
    from llmkit.scheduler.base import Scheduler

    for info in pkgutil.iter_modules(llmkit.tools.sim.__path__):
        if info.name == "gpu_check":
            continue
        mod = importlib.import_module(f"llmkit.tools.sim.{info.name}")
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            assert not issubclass(obj, (Scheduler, KVCacheManagerBase)), obj


# --------------------------------------------------------------------------- the KV pool

def test_kv_pool_is_the_memory_left_after_weights():
    cfg = cfg_of()
    core, ex, _ = build_sim_engine(cfg)
    weights = ex.cost_model.weight_bytes
    assert weights == 6_738_415_616 * 2
    budget = 80e9 * 0.9 - weights - ex.activation_bytes()
    assert core.num_blocks == int(budget // (16 * 524288))
    assert 6000 < core.num_blocks < 7500  # ~110k tokens of KV on an A100-80GB
    # a user's kv_cache.num_blocks wins
    core2, _, _ = build_sim_engine(cfg_of("kv_cache.num_blocks=100"))
    assert core2.num_blocks == 100


def test_a_model_that_does_not_fit_fails_at_start_with_the_key():
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError, match="sim.tensor_parallel_size") as e:
        build_sim_engine(cfg_of("sim.model=llama-2-70b"))
    assert "GB of weights per device" in str(e.value)
    core, ex, _ = build_sim_engine(cfg_of("sim.model=llama-2-70b", "hardware=h200",
                                          "sim.tensor_parallel_size=2"))
    assert core.num_blocks > 0 and ex.cost_model.tp == 2


# --------------------------------------------------------------------------- the loop

def test_replay_follows_the_workload_and_frees_every_block():
    cfg = cfg_of("bench.num_requests=40", "bench.rate=20", "bench.input_len=200",
                 "bench.output_len=50", "bench.range_ratio=0.5", "kv_cache.num_blocks=64")
    from llmkit.tools.sim.source import VocabTokenizer
    workload = build_workload(cfg.bench, VocabTokenizer(32000, [2]))
    core, ex, clock = build_sim_engine(cfg)
    run = replay(cfg, workload, core, clock)
    assert len(run.records) == 40 and run.num_unsent == 0
    for w, r in zip(workload, run.records):
        assert r.ok and r.request_id == w.request_id
        assert r.prompt_tokens == w.prompt_len
        assert r.output_tokens == w.max_tokens  # output lengths follow the workload
        assert r.start_s == w.arrival_s  # sent on arrival (taken in at the next step)
    # few blocks for this load: the real scheduler had to preempt, and every block came back
    assert core.stats().num_preemptions_total > 0
    assert core.kv_cache_manager.usage == 0
    assert not core.has_unfinished_requests()
    assert run.duration_s == pytest.approx(clock())
    assert ex.stats.busy_s <= clock() + 1e-9


class FixedCost:
    """A cost model stand-in: a step with a prefill costs ``ttft``, a pure decode ``tpot``."""

    def __init__(self, ttft: float, tpot: float) -> None:
        self.ttft, self.tpot = ttft, tpot

    def step(self, work, stream_rate=0.0):
        work = list(work)
        if not work:
            return StepCost(0, 0, 0, 0, 0, 0, 0, 0)
        t = self.ttft if any(q > 1 for q, _, _ in work) else self.tpot
        return StepCost(t, 0, 0, 0, 0, 0, sum(q for q, _, _ in work), len(work))


def test_seed_300_token_answer_at_ttft_300ms_tpot_30ms_ends_at_9_3s():
    # seed ch. 02: E2E ≈ 0.3 + 299 × 0.03 ≈ 9.3 s, decode ≈ 97% of it
    cfg = cfg_of("bench.num_requests=1")
    core, ex, clock = build_sim_engine(cfg)
    ex.cost_model = FixedCost(0.3, 0.03)
    w = WorkloadRequest("a", 300, arrival_s=0.0, prompt_token_ids=list(range(10, 210)),
                        prompt_len=200)
    run = replay(cfg, [w], core, clock)
    (r,) = run.records
    assert r.output_tokens == 300
    assert r.ttft_ms == pytest.approx(300) and r.tpot_ms == pytest.approx(30)
    assert r.e2el_ms / 1e3 == pytest.approx(0.3 + 299 * 0.03)
    assert 9.3 * 0.9 <= r.e2el_ms / 1e3 <= 9.3 * 1.1
    assert (r.e2el_ms - r.ttft_ms) / r.e2el_ms == pytest.approx(0.97, abs=0.01)
    s = summarize(run.records, None, run.duration_s)
    assert s["e2el_ms"]["mean"] == pytest.approx(9270)


def test_queueing_is_part_of_ttft_and_concurrency_waits_are_not():
    cfg = cfg_of("bench.max_concurrency=1")
    core, ex, clock = build_sim_engine(cfg)
    ex.cost_model = FixedCost(0.1, 0.01)
    ws = [WorkloadRequest(f"r{i}", 5, arrival_s=0.0, prompt_token_ids=[5, 6, 7],
                          prompt_len=3) for i in range(2)]
    r0, r1 = replay(cfg, ws, core, clock).records
    assert r0.queue_ms == 0 and r0.e2el_ms == pytest.approx(100 + 4 * 10)
    # r1 is sent when r0 ends: that wait is queue_ms, not TTFT
    assert r1.queue_ms == pytest.approx(r0.e2el_ms) and r1.ttft_ms == pytest.approx(100)


def test_a_request_arriving_mid_step_waits_for_it_in_its_ttft():
    # The client sends at arrival; the engine takes the request in when the running step
    # ends, so (as against a real server) that rest of the step is part of the TTFT.
    cfg = cfg_of()
    core, ex, clock = build_sim_engine(cfg)
    ex.cost_model = FixedCost(0.3, 0.03)
    ws = [WorkloadRequest("a", 20, arrival_s=0.0, prompt_token_ids=[5, 6, 7], prompt_len=3),
          WorkloadRequest("b", 20, arrival_s=0.1, prompt_token_ids=[8, 9, 10], prompt_len=3)]
    ra, rb = replay(cfg, ws, core, clock).records
    assert ra.ttft_ms == pytest.approx(300)
    # b arrives 0.1 s into a's 0.3 s prefill, is prefilled in the next step (0.3 -> 0.6 s)
    assert rb.start_s == 0.1 and rb.queue_ms == 0
    assert rb.ttft_ms == pytest.approx(500)


def test_max_duration_drops_unsent_and_cancels_in_flight():
    cfg = cfg_of("bench.max_duration_s=1.0")
    core, ex, clock = build_sim_engine(cfg)
    ex.cost_model = FixedCost(0.1, 0.1)
    ws = [WorkloadRequest("a", 100, arrival_s=0.0, prompt_token_ids=[5, 6], prompt_len=2),
          WorkloadRequest("late", 5, arrival_s=2.0, prompt_token_ids=[5, 6], prompt_len=2)]
    run = replay(cfg, ws, core, clock)
    (r,) = run.records
    assert run.num_unsent == 1 and not r.ok and "max_duration_s" in r.error
    assert run.duration_s == 1.0 and core.kv_cache_manager.usage == 0


def test_a_prompt_longer_than_max_model_len_is_a_failed_record():
    cfg = cfg_of("sim.max_model_len=64")
    core, ex, clock = build_sim_engine(cfg)
    ws = [WorkloadRequest("long", 5, prompt_token_ids=list(range(3, 103)), prompt_len=100),
          WorkloadRequest("ok", 5, prompt_token_ids=[3, 4, 5], prompt_len=3)]
    bad, good = replay(cfg, ws, core, clock).records
    assert not bad.ok and "max_model_len=64" in bad.error and good.ok


# --------------------------------------------------------------------------- run_sim

def test_run_sim_is_deterministic_and_shaped_like_bench_serve():
    over = ("bench.num_requests=60", "bench.rate=30", "bench.input_len=256",
            "bench.output_len=32", "bench.range_ratio=0.5", "slo.ttft_ms=200",
            "slo.tpot_ms=20")
    a = run_sim(cfg_of(*over))
    b = run_sim(cfg_of(*over))
    assert strip_wall(a) == strip_wall(b)
    c = run_sim(cfg_of(*over, "bench.seed=1"))
    assert c["requests"] != a["requests"]
    # API.md's result shape
    assert list(a)[:4] == ["config", "simulated", "summary", "requests"]
    assert a["simulated"] is True and a["kind"] == "sim"
    for k in ("num_requests", "completed", "failed", "duration_s", "request_throughput",
              "output_throughput", "goodput"):
        assert k in a["summary"]
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(a["summary"][m]) >= {"mean", "p50", "p90", "p99"}
    rec = a["requests"][0]
    for k in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "prompt_tokens", "output_tokens", "ok"):
        assert k in rec
    assert a["summary"]["completed"] == 60 and a["summary"]["num_unsent"] == 0
    assert a["config"]["hardware"] == "a100-80gb" and a["config"]["served_model"] == "llama-2-7b"
    assert 0 < a["summary"]["goodput"] <= a["summary"]["request_throughput"]
    sim = a["sim"]
    assert sim["model"]["num_params"] == 6_738_415_616 and sim["cost_model"]["dtype"] == "float16"
    assert 0 < sim["mbu"] < 1 and 0 < sim["mfu"] < 1


def test_faster_hardware_gives_lower_latency_on_the_same_workload():
    over = ("bench.num_requests=30", "bench.rate=10", "bench.output_len=32")
    a100 = run_sim(cfg_of(*over))["summary"]
    h200 = run_sim(cfg_of(*over, "hardware=h200"))["summary"]
    assert h200["tpot_ms"]["mean"] < 0.7 * a100["tpot_ms"]["mean"]
    assert h200["e2el_ms"]["p50"] < a100["e2el_ms"]["p50"]


def test_virtual_clock():
    c = VirtualClock()
    assert c() == 0 and c.advance(0.5) == 0.5 and c.advance_to(0.2) == 0.5
    assert c.advance_to(2.0) == 2.0 and c.now == 2.0
    with pytest.raises(ValueError):
        c.advance(-1)


def test_executor_sim_by_name_in_a_plain_engine_core():
    """``executor=sim`` is an ordinary registered executor: an EngineCore built from config
    alone runs with it (no clock: steps are priced, nothing waits)."""
    from llmkit.engine.loop.core import EngineCore
    from llmkit.request import Request
    from llmkit.sampling.params import SamplingParams

    cfg = cfg_of("executor=sim", "kv_cache.num_blocks=64")
    core = EngineCore(cfg.engine, settings=cfg)
    core.add_request(Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    assert len(tokens) == 6 and 2 not in tokens  # never EOS: ends at max_tokens
    assert core.executor.stats.steps == 6 and core.executor.stats.busy_s > 0
    assert core.kv_cache_manager.usage == 0
