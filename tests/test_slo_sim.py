"""scheduler=slo in the simulator: the real scheduler predicting with the simulator's own cost
model, so a load that breaks the TPOT objective under the token-budget scheduler keeps every
request's TPOT within it; and bench serve's SLO attainment per objective."""
from __future__ import annotations

from helpers.sim_config import cfg_of

from llmkit.tools.bench.metrics import request_record, summarize
from llmkit.tools.sim.replay import run_sim

# Llama-2-7B on an H100: long prompts arriving while others decode
LOAD = ["hardware=h100-sxm", "bench.num_requests=24", "bench.rate=20", "bench.input_len=2048",
        "bench.output_len=64", "scheduler.max_num_batched_tokens=8192", "slo.tpot_ms=25",
        "slo.ttft_ms=5000"]


def test_slo_scheduler_keeps_tpot_where_the_token_budget_one_breaks_it():
    base = run_sim(cfg_of(*LOAD))["summary"]
    slo = run_sim(cfg_of(*LOAD, "scheduler=slo"))["summary"]
    assert base["tpot_ms"]["p99"] > 25  # the load breaks TPOT with big mixed steps
    assert slo["tpot_ms"]["p99"] <= 25 + 1e-6
    assert slo["completed"] == base["completed"] == 24
    att = slo["slo_attainment_by_metric"]
    assert att["tpot"] == 1.0 and att["e2el"] is None
    assert att["all"] == slo["slo_attainment"]


def test_attainment_per_objective_counts_requests_sent():
    # TTFT 100 / 300 ms; TPOT 50 / 150 ms; one failed request
    recs = [request_record(0.0, [0.1, 0.15, 0.2], output_tokens=3),
            request_record(0.0, [0.3, 0.6, 0.9], output_tokens=3),
            request_record(0.0, [], ok=False, error="boom")]
    s = summarize(recs, {"ttft_ms": 200, "tpot_ms": 100}, 1.0)
    att = s["slo_attainment_by_metric"]
    assert att == {"ttft": 1 / 3, "tpot": 1 / 3, "e2el": None, "all": 1 / 3}
    s = summarize(recs, {"ttft_ms": 500}, 1.0)
    assert s["slo_attainment_by_metric"]["ttft"] == 2 / 3
