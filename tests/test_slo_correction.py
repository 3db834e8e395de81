"""scheduler=slo learning from measured steps (slo_correction.py) and never starving prefills.

The simulator is the reference for the correction: its steps take what the executor's cost
model says (the truth), while the scheduler predicts with a profile twice as fast
(``scheduler.cost_profile``: every time term halved), as a server whose profile under-predicts
its served steps does. The engine core hands each step's measured (virtual) time to the
scheduler, which must learn the factor 2 exactly and then keep TPOT inside its objective; with
the correction off the same load misses it.
"""
from __future__ import annotations

from helpers.slo_clock import Clock
from helpers.slo_clock import linear_step_time as true_step

import logging
import math

import pytest
import yaml
from helpers.scheduler_driver import fake_run
from helpers.sim_config import cfg_of

from llmkit.config.errors import ConfigError
from llmkit.config.schema import SchedulerConfig, SloConfig
from llmkit.cost_model.hardware import load_profile_yaml, shipped_profile_path
from llmkit.kv_cache import KVCacheManager
from llmkit.request import Request, RequestStatus
from llmkit.sampling import SamplingParams
from llmkit.scheduler.slo import SloScheduler
from llmkit.scheduler.slo_correction import StepCorrection
from llmkit.tools.bench.datasets import build_workload
from llmkit.tools.bench.metrics import summarize
from llmkit.tools.sim.replay import build_sim_engine, replay
from llmkit.tools.sim.source import resolve_sim_model, workload_tokenizer

# test_slo_sim's load: Llama-2-7B on an H100, long prompts arriving while others decode
LOAD = ["hardware=h100-sxm", "bench.num_requests=24", "bench.rate=20", "bench.input_len=2048",
        "bench.output_len=64", "scheduler.max_num_batched_tokens=8192", "slo.tpot_ms=25",
        "slo.ttft_ms=5000", "scheduler=slo"]


@pytest.fixture(scope="module")
def half_profile(tmp_path_factory) -> str:
    """The H100 profile with every time term halved: predicts each step at half its time."""
    d = load_profile_yaml(shipped_profile_path("h100-sxm"))
    d["name"] = "h100-twice-as-fast"
    d["peak_tflops"] = {k: 2 * v for k, v in d["peak_tflops"].items()}
    d["memory_bandwidth_gbs"] *= 2
    d["link_bandwidth_gbs"] *= 2
    d["link_latency_us"] /= 2
    d["step_overhead_ms"] /= 2
    d["layer_overhead_us"] /= 2
    path = tmp_path_factory.mktemp("hw") / "half.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def simulate(*overrides: str):
    cfg = cfg_of(*LOAD, *overrides)
    model = resolve_sim_model(cfg)
    core, _, clock = build_sim_engine(cfg, model=model)
    try:
        run = replay(cfg, build_workload(cfg.bench, workload_tokenizer(cfg, model)), core, clock)
    finally:
        core.shutdown()
    return summarize(run.records, cfg.slo, run.duration_s), core.scheduler.slo_policy


def test_correction_learns_the_served_steps_and_keeps_tpot(half_profile, caplog):
    truth, _ = simulate()
    assert truth["tpot_ms"]["p99"] <= 25 + 1e-6  # predicting with the truth keeps TPOT
    off, policy_off = simulate(f"scheduler.cost_profile={half_profile}",
                               "scheduler.slo_correction_weight=0")
    assert off["tpot_ms"]["p99"] > 25 * 1.05  # half the truth: chunks twice too big
    assert policy_off.correction.describe() == {"decode": 1.0, "mixed": 1.0}
    with caplog.at_level(logging.INFO, logger="llmkit.scheduler.slo_policy"):
        on, policy = simulate(f"scheduler.cost_profile={half_profile}")
    assert any("decode-only steps served take 2.00x the cost model's prediction (32 measured)"
               in r.getMessage() for r in caplog.records)
    # the engine measured each step's virtual time: exactly twice the prediction
    assert policy.correction.factor(False) == pytest.approx(2.0, rel=1e-9)
    assert policy.correction.factor(True) == pytest.approx(2.0, rel=1e-9)
    assert min(policy.correction.steps) > 10
    assert on["tpot_ms"]["p99"] <= 25 * 1.02  # within 2%: the first steps are priced at 1x
    assert on["completed"] == 24


def test_step_correction_follows_each_kind_and_clips_outliers():
    c = StepCorrection(0.5)
    assert c.factor(False) == c.factor(True) == 1.0
    c.observe(False, 0.010, 0.020)
    assert c.factor(False) == c.factor(True) == pytest.approx(2.0)  # mixed borrows decode's
    c.observe(True, 0.100, 0.150)
    assert c.factor(True) == pytest.approx(1.5) and c.factor(False) == 2.0
    c.observe(False, 0.010, 10.0)  # a stall: clipped to 4x the current factor (8x)
    assert c.factor(False) == pytest.approx((0.020 + 0.5 * (0.080 - 0.020)) / 0.010)
    off = StepCorrection(0.0)
    off.observe(False, 0.010, 0.020)
    assert off.factor(False) == 1.0
    with pytest.raises(ValueError, match="weight"):
        StepCorrection(1.5)


def test_correction_weight_needs_the_slo_scheduler():
    with pytest.raises(ConfigError, match=r"scheduler\.slo_correction_weight"):
        cfg_of("scheduler.slo_correction_weight=0.5")
    with pytest.raises(ConfigError, match=r"scheduler\.slo_correction_weight"):
        cfg_of("scheduler=slo", "slo.tpot_ms=50", "scheduler.slo_correction_weight=2")


# -- prefills never starve ------------------------------------------------------------------



def serve(sched, clock, n: int, every_s: float, prompt: int, out: int) -> dict[str, float]:
    """Requests arriving every ``every_s``; each step advances the clock by its true time (the
    scheduler is told it, as the engine core does). Returns each request's TTFT."""
    arrivals = [(i * every_s, f"r{i}") for i in range(n)]
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    while arrivals or sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= clock.t:
            t, rid = arrivals.pop(0)
            base = 1000 * (1 + int(rid[1:]))
            sched.add_request(Request(rid, list(range(base, base + prompt)),
                                      SamplingParams(max_tokens=out), arrival_time=t))
            arrived[rid] = t
        if not sched.has_unfinished_requests():
            clock.t = arrivals[0][0]
            continue
        so = sched.schedule()
        work = []
        for rid, k in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            work.append((k, r.num_computed_tokens, r.num_computed_tokens >= r.num_tokens))
        step_s = true_step(work)
        clock.t += step_s
        for o in fake_run_timed(sched, so, step_s):
            if o.new_token_ids:
                first.setdefault(o.request_id, clock.t - arrived[o.request_id])
    return first


def fake_run_timed(sched, so, step_s):
    from llmkit.outputs import ModelRunnerOutput
    sampled = []
    for rid in so.num_scheduled_tokens:
        r = sched.requests.get(rid)
        sampled.append([7] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    return sched.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled),
                                    step_s=step_s)


def test_prefills_do_not_starve_when_tpot_leaves_no_room():
    """TPOT 12 ms: a few decodes alone (10 ms + 1 ms each) are over it, so TPOT leaves no
    prefill room. A 160-token prompt every 250 ms (640 tokens/s), 20 tokens out: the
    token-budget scheduler serves that (a prompt's step takes ~175 ms). One block a step (16
    tokens in a ~30 ms step, ~500 tokens/s) would let TTFT grow with every request; the TTFT
    floor keeps each prompt within its 1 s deadline."""
    clock = Clock()
    config = SchedulerConfig(name="slo", max_num_batched_tokens=1024)
    kv = KVCacheManager(4000, 16, enable_prefix_caching=False, max_model_len=4096)
    sched = SloScheduler(config, kv, max_model_len=4096, slo=SloConfig(tpot_ms=12, ttft_ms=1000),
                         step_time=true_step, clock=clock)
    ttft = serve(sched, clock, n=40, every_s=0.25, prompt=160, out=20)
    assert len(ttft) == 40
    assert max(ttft.values()) <= 1.0 + 0.05, sorted(ttft.values())[-5:]


def test_with_defer_the_given_up_ones_do_not_raise_the_room():
    """With admission=defer, a request predicted to miss TTFT at the TPOT room is deferred and
    does not force big chunks: the decodes keep their TPOT room (one block while it waits)."""
    clock = Clock()
    config = SchedulerConfig(name="slo", max_num_batched_tokens=1024, slo_admission="defer")
    kv = KVCacheManager(400, 16, enable_prefix_caching=False, max_model_len=4096)
    sched = SloScheduler(config, kv, max_model_len=4096, slo=SloConfig(tpot_ms=12, ttft_ms=100),
                         step_time=true_step, clock=clock)
    for i in range(4):
        sched.add_request(Request(f"d{i}", list(range(100 * i + 5, 100 * i + 13)),
                                  SamplingParams(max_tokens=50)))
    fake_run(sched, sched.schedule())
    sched.add_request(Request("long", list(range(5000, 5600)), SamplingParams(max_tokens=2)))
    so = sched.schedule()
    assert sched.slo_policy.num_deferred == 1
    assert so.num_scheduled_tokens.get("long", 0) <= 16
    # admission off: the same request raises the room to what its deadline needs
    sched2 = SloScheduler(SchedulerConfig(name="slo", max_num_batched_tokens=1024), 
                          KVCacheManager(400, 16, enable_prefix_caching=False,
                                         max_model_len=4096),
                          max_model_len=4096, slo=SloConfig(tpot_ms=12, ttft_ms=100),
                          step_time=true_step, clock=clock)
    for i in range(4):
        sched2.add_request(Request(f"d{i}", list(range(100 * i + 5, 100 * i + 13)),
                                   SamplingParams(max_tokens=50)))
    fake_run(sched2, sched2.schedule())
    sched2.add_request(Request("long", list(range(5000, 5600)), SamplingParams(max_tokens=2)))
    so = sched2.schedule()
    assert so.num_scheduled_tokens["long"] > 16
    assert math.isfinite(sched2.slo_policy.predicted_step_s)


# -- slo_tpot=mean ----------------------------------------------------------------------------

def test_mean_tpot_spends_the_slack_decodes_banked():
    """Two requests decode, 10 tokens out each, 0.3 s after their first token (TPOT 50 ms: 0.45
    s allowed): the one least ahead is 0.15 s ahead, so a step may take 50 + 150 ms in mean
    mode (a 188-token chunk beside the decodes at 10 ms + 1 ms a token), 50 ms in step mode."""
    rooms = {}
    for mode in ("step", "mean"):
        clock = Clock()
        config = SchedulerConfig(name="slo", max_num_batched_tokens=1024, slo_tpot=mode)
        kv = KVCacheManager(400, 16, enable_prefix_caching=False, max_model_len=4096)
        sched = SloScheduler(config, kv, max_model_len=4096, slo=SloConfig(tpot_ms=50),
                             step_time=true_step, clock=clock)
        for i in range(2):
            sched.add_request(Request(f"d{i}", list(range(100 * i + 5, 100 * i + 13)),
                                      SamplingParams(max_tokens=50)))
        for _ in range(10):
            fake_run(sched, sched.schedule())
        for r in sched.running:  # first token at 1.0 s, the last at 1.3 s
            r.times.token_times[:] = [1.0 + 0.3 * k / 9 for k in range(10)]
        clock.t = 1.3
        sched.add_request(Request("long", list(range(5000, 5600)), SamplingParams(max_tokens=2)))
        so = sched.schedule()
        rooms[mode] = so.num_scheduled_tokens["long"]
        assert sched.slo_policy.step_limit == pytest.approx(0.050 if mode == "step" else 0.200)
    assert rooms["step"] == 38 and 187 <= rooms["mean"] <= 188  # (188: at the limit, in floats)


def test_slo_tpot_needs_the_slo_scheduler():
    with pytest.raises(ConfigError, match=r"scheduler\.slo_tpot"):
        cfg_of("scheduler.slo_tpot=mean")


# -- admission keeps the running requests' TPOT ---------------------------------------------

def _two_decoding(admission: str, prompt: int) -> SloScheduler:
    """Two requests decode (50 tokens each, 10 out, the first at 0 s, now 1.3 s; TPOT 50 ms:
    slack 2.45 - 1.3 - 40 x 12 ms = 0.67 s each), then a prompt of ``prompt`` tokens arrives;
    a step costs 10 ms + 1 ms a token, so the prompt adds ``prompt`` ms to their steps."""
    clock = Clock()
    config = SchedulerConfig(name="slo", max_num_batched_tokens=1024, slo_admission=admission)
    kv = KVCacheManager(400, 16, enable_prefix_caching=False, max_model_len=4096)
    sched = SloScheduler(config, kv, max_model_len=4096,
                         slo=SloConfig(tpot_ms=50, ttft_ms=60000), step_time=true_step,
                         clock=clock)
    for i in range(2):
        sched.add_request(Request(f"d{i}", list(range(100 * i + 5, 100 * i + 13)),
                                  SamplingParams(max_tokens=50)))
    for _ in range(10):
        fake_run(sched, sched.schedule())
    for r in sched.running:
        r.times.token_times[:] = [1.3 * k / 9 for k in range(10)]
    clock.t = 1.3
    sched.add_request(Request("long", list(range(5000, 5000 + prompt)),
                              SamplingParams(max_tokens=2), arrival_time=1.3))
    return sched


@pytest.mark.parametrize("admission", ["reject", "defer"])
def test_a_prompt_that_would_push_decodes_over_tpot_waits(admission):
    sched = _two_decoding(admission, 800)  # 0.8 s > 0.67 s of slack
    so = sched.schedule()
    assert "long" not in so.num_scheduled_tokens and set(so.num_scheduled_tokens) == {"d0", "d1"}
    assert sched.requests["long"].status == RequestStatus.WAITING
    assert sched.slo_policy.num_rejected == sched.slo_policy.num_deferred == 0
    sched = _two_decoding(admission, 600)  # 0.6 s: within the slack
    assert "long" in sched.schedule().num_scheduled_tokens


def test_without_admission_the_prompt_is_admitted():
    assert "long" in _two_decoding("off", 800).schedule().num_scheduled_tokens
