"""The metric definitions (llmkit/tools/bench/metrics.py) on synthetic timestamps with known
answers, the workload generators (datasets, arrivals) and the result file's shape."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from llmkit.tools.bench.arrivals import arrival_times
from llmkit.tools.bench.datasets import build_workload, load_jsonl
from llmkit.tools.bench.metrics import (RequestRecord, Slo, meets_slo, percentile, request_record,
                                  stats, summarize)
from llmkit.config.compose import compose_config
from llmkit.config.errors import ConfigError
from llmkit.tools.bench.results import make_result, plot_serve_result, write_result
from llmkit.tools.compose import compose_tool_config
from llmkit.tools.schema import BenchToolConfig, EvalToolConfig, SimToolConfig


# --------------------------------------------------------------------------- one request

def test_request_metrics_known_answers():
    # sent at 10.0; chunks at 10.5, 10.6, 10.8, 11.0; 4 tokens
    r = request_record(10.0, [10.5, 10.6, 10.8, 11.0], 11.0, output_tokens=4, prompt_tokens=7)
    assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 7
    assert r.ttft_ms == pytest.approx(500.0)
    assert r.e2el_ms == pytest.approx(1000.0)
    # TPOT = (E2E - TTFT) / (output tokens - 1) = 500 / 3
    assert r.tpot_ms == pytest.approx(500.0 / 3)
    assert r.itl_ms == pytest.approx([100.0, 200.0, 200.0])


def test_ttft_includes_queueing():
    """The request arrives at t=1.0, waits in the server's queue until 1.4, prefills, and its
    first token comes at 1.5: TTFT is 500 ms (from arrival), not 100 ms (from scheduling)."""
    arrival, first_scheduled, first_token = 1.0, 1.4, 1.5
    r = request_record(arrival, [first_token, 1.6], output_tokens=2)
    assert r.ttft_ms == pytest.approx(500.0)
    assert r.ttft_ms != pytest.approx(1e3 * (first_token - first_scheduled))
    # and E2E latency counts from the arrival too
    assert r.e2el_ms == pytest.approx(600.0)


def test_tpot_uses_reported_token_count_not_chunks():
    # 2 chunks but the server reported 5 tokens (several tokens per chunk), with no count per
    # chunk: the 3 tokens no chunk announced are put on the last one
    r = request_record(0.0, [0.2, 1.0], 1.0, output_tokens=5)
    assert r.tpot_ms == pytest.approx((1000.0 - 200.0) / 4)
    assert r.itl_ms == pytest.approx([200.0] * 4)


def test_itl_has_one_entry_per_token_split_over_each_chunk():
    """Chunks of 2, 1, 3 tokens at 0.2, 0.5, 1.1 s: the first chunk's second token has ITL 0,
    the second chunk's gap is its one token's, the third's 600 ms is split over 3 tokens."""
    r = request_record(0.0, [0.2, 0.5, 1.1], 1.1, output_tokens=6, chunk_tokens=[2, 1, 3])
    assert r.itl_ms == pytest.approx([0.0, 300.0, 200.0, 200.0, 200.0])
    assert len(r.itl_ms) == r.output_tokens - 1
    assert sum(r.itl_ms) / len(r.itl_ms) == pytest.approx(r.tpot_ms)
    # a finish that came alone (0 tokens at 0.9) is no token time; the one token of the
    # reported total that no chunk announced goes on the last chunk with tokens (0.5 s)
    r = request_record(0.0, [0.2, 0.5, 0.9], 0.9, output_tokens=4, chunk_tokens=[1, 2, 0])
    assert r.itl_ms == pytest.approx([100.0, 100.0, 100.0])
    assert r.e2el_ms == pytest.approx(900.0)
    with pytest.raises(ValueError, match="one count per chunk"):
        request_record(0.0, [0.2, 0.5], output_tokens=3, chunk_tokens=[3])


def test_end_after_last_chunk_counts_in_e2e_and_tpot():
    r = request_record(0.0, [0.1, 0.2, 0.3], 0.5, output_tokens=3)
    assert r.e2el_ms == pytest.approx(500.0)
    assert r.tpot_ms == pytest.approx((500.0 - 100.0) / 2)


def test_single_token_has_no_tpot_and_meets_tpot_slo():
    r = request_record(0.0, [0.3], output_tokens=1)
    assert r.tpot_ms is None and r.itl_ms == [] and r.ttft_ms == pytest.approx(300.0)
    assert meets_slo(r, Slo(tpot_ms=1.0))
    assert not meets_slo(r, Slo(ttft_ms=100.0))


def test_no_tokens_or_error_is_not_ok():
    r = request_record(0.0, [], 1.0)
    assert not r.ok and r.ttft_ms is None and r.error
    r = request_record(0.0, [0.1], 0.2, ok=False, error="HTTP 400: bad")
    assert not r.ok and r.error == "HTTP 400: bad"
    assert not meets_slo(r, Slo())


def test_bad_timestamps_raise():
    with pytest.raises(ValueError):
        request_record(1.0, [0.5])
    with pytest.raises(ValueError):
        request_record(0.0, [0.5, 0.4])


# --------------------------------------------------------------------------- goodput

def _rec(ttft, tpot, e2el, out=10, ok=True):
    return RequestRecord(ttft, tpot, e2el, [tpot] * (out - 1) if tpot else [], 5, out, ok)


def test_goodput_counts_a_request_only_if_every_slo_holds():
    slo = Slo(ttft_ms=200, tpot_ms=50, e2el_ms=1000)
    records = [
        _rec(100, 40, 500),          # meets all three
        _rec(300, 40, 500),          # TTFT violated
        _rec(100, 60, 700),          # TPOT violated
        _rec(100, 40, 1500),         # E2E violated
        _rec(100, 40, 500, ok=False),  # failed: never good
        _rec(200, 50, 1000),         # exactly at every limit: meets
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False, False, True]
    s = summarize(records, slo, duration_s=2.0)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["good_requests"] == 2
    assert s["request_throughput"] == pytest.approx(5 / 2.0)
    # one SLO at a time: goodput is monotone in how many objectives are set
    assert summarize(records, Slo(ttft_ms=200), 2.0)["goodput"] == pytest.approx(4 / 2.0)
    # no SLO: goodput = request throughput
    no_slo = summarize(records, None, 2.0)
    assert no_slo["goodput"] == no_slo["request_throughput"]


def test_summary_keys_and_consistency():
    rng = random.Random(0)
    records = []
    for i in range(50):
        t0 = rng.uniform(0, 5)
        n = rng.randint(1, 20)
        times = [t0 + rng.uniform(0.05, 0.5)]
        for _ in range(n - 1):
            times.append(times[-1] + rng.uniform(0.01, 0.1))
        records.append(request_record(t0, times, output_tokens=n, prompt_tokens=rng.randint(1, 99),
                                      ok=i % 10 != 3, error=None if i % 10 != 3 else "x"))
    s = summarize(records, {"ttft_ms": 300, "tpot_ms": None, "e2el_ms": None}, 10.0)
    for key in ("num_requests", "completed", "failed", "duration_s", "request_throughput",
                "output_throughput", "goodput"):
        assert key in s
    assert s["num_requests"] == 50 and s["failed"] == 5 and s["completed"] == 45
    done = [r for r in records if r.ok]
    assert s["total_output_tokens"] == sum(r.output_tokens for r in done)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / 10.0)
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(s[m]) == {"mean", "p50", "p90", "p99"}
        assert s[m]["p50"] <= s[m]["p90"] <= s[m]["p99"]
    ttfts = [r.ttft_ms for r in done]
    assert s["ttft_ms"]["mean"] == pytest.approx(np.mean(ttfts))
    assert s["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    itls = [x for r in done for x in r.itl_ms]
    assert s["itl_ms"]["p90"] == pytest.approx(np.percentile(itls, 90))
    assert s["goodput"] == pytest.approx(sum(r.ttft_ms <= 300 for r in done) / 10.0)


def test_percentile_matches_numpy_and_empty_stats():
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summarize([], None, 0.0)["ttft_ms"]["p99"] is None


# --------------------------------------------------------------------------- workloads

def bench_cfg(**kw):
    return compose_tool_config(BenchToolConfig, [f"bench.{k}={v}" for k, v in kw.items()]).bench


class FakeTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 100

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{t}" for t in ids)


def test_arrivals():
    assert arrival_times(4, float("inf"), "poisson") == [0.0] * 4
    assert arrival_times(3, 2.0, "burst") == [0.0] * 3
    assert arrival_times(4, 4.0, "constant") == [0.0, 0.25, 0.5, 0.75]
    a = arrival_times(4000, 8.0, "poisson", seed=3)
    assert a == arrival_times(4000, 8.0, "poisson", seed=3)  # pure
    assert a != arrival_times(4000, 8.0, "poisson", seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    # exponential gaps: mean 1/rate, coefficient of variation 1 (loose bounds, n=4000)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_random_dataset_lengths_and_determinism():
    cfg = bench_cfg(num_requests=200, input_len=40, output_len=10, range_ratio=0.5,
                    rate=4, seed=5)
    w = build_workload(cfg, FakeTokenizer())
    assert w == build_workload(cfg, FakeTokenizer())
    assert len(w) == 200
    assert all(20 <= r.prompt_len == len(r.prompt_token_ids) <= 60 for r in w)
    assert all(5 <= r.max_tokens <= 15 for r in w)
    assert all(3 <= t < 100 for r in w for t in r.prompt_token_ids)  # no special ids
    assert [r.arrival_s for r in w] == arrival_times(200, 4.0, "poisson", seed=5)
    assert len({r.request_id for r in w}) == 200
    fixed = build_workload(bench_cfg(num_requests=5, input_len=8, output_len=3), FakeTokenizer())
    assert [(r.prompt_len, r.max_tokens) for r in fixed] == [(8, 3)] * 5


def test_shared_prefix_dataset():
    cfg = bench_cfg(dataset="shared_prefix", num_requests=9, num_prefixes=3, prefix_len=16,
                    input_len=4, output_len=2)
    w = build_workload(cfg, FakeTokenizer())
    assert [r.prefix_id for r in w] == [0, 1, 2] * 3
    for r in w:
        same = [o for o in w if o.prefix_id == r.prefix_id]
        assert all(o.prompt_token_ids[:16] == r.prompt_token_ids[:16] for o in same)
        assert r.prompt_len == 20
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in w}
    suffixes = {tuple(r.prompt_token_ids[16:]) for r in w}
    assert len(prefixes) == 3 and len(suffixes) == 9


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "w5 w6 w7", "max_tokens": 4}\n\n'
                    '{"prompt": [9, 8], "max_tokens": 2}\n{"prompt": "w3"}\n')
    w = build_workload(bench_cfg(dataset="jsonl", dataset_path=str(path), output_len=6),
                       FakeTokenizer())
    assert [(r.prompt, r.prompt_token_ids, r.max_tokens, r.prompt_len) for r in w] == [
        ("w5 w6 w7", [5, 6, 7], 4, 3), (None, [9, 8], 2, 2), ("w3", [3], 6, 1)]
    assert [r.payload_prompt for r in w] == ["w5 w6 w7", [9, 8], "w3"]
    # bounded by num_requests; no tokenizer: text prompts have unknown lengths
    w = build_workload(bench_cfg(dataset="jsonl", dataset_path=str(path), num_requests=1), None)
    assert len(w) == 1 and w[0].prompt_len is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: max_tokens"):
        load_jsonl(bad)


def test_text_prompt_format():
    w = build_workload(bench_cfg(num_requests=3, input_len=5, prompt_format="text"),
                       FakeTokenizer())
    assert all(isinstance(r.prompt, str) and r.prompt_len == 5 for r in w)
    assert all(r.payload_prompt == r.prompt for r in w)


def test_bench_config_keys_and_errors():
    cfg = compose_tool_config(BenchToolConfig, ["bench.rate=inf", "bench.arrival=constant",
                                                 "slo.ttft_ms=250", "bench.max_concurrency=4"])
    assert math.isinf(cfg.bench.rate) and cfg.slo.ttft_ms == 250
    # the engine's config holds no tool's section: its root (conf/config.yaml) rejects their
    # keys, naming them; the tools' root validates every tool's sections whichever tool runs.
    # slo.* is the engine's too (scheduler=slo serves to it, API.md): one section, the same
    # objectives for the server and the benchmark
    assert not {"bench", "hardware", "sim"} & set(type(cfg.engine).model_fields)
    assert cfg.engine.slo == cfg.slo
    with pytest.raises(ConfigError, match=r"bench\.rate.*a key of the config: model"):
        compose_config(["bench.rate=4"])
    with pytest.raises(ConfigError, match="bench.arrival"):
        compose_tool_config(SimToolConfig, ["bench.arrival=gamma"])
    with pytest.raises(ConfigError, match="bench.dataset_path"):
        compose_tool_config(EvalToolConfig, ["bench.dataset=jsonl"])
    with pytest.raises(ConfigError, match="slo.ttft_ms"):
        compose_tool_config(BenchToolConfig, ["slo.ttft_ms=-1"])
    from llmkit.tools.schema import BenchConfig
    assert compose_tool_config(BenchToolConfig).bench == BenchConfig()
    # a config with rate=inf survives JSON (the engine process gets its config that way)
    assert math.isinf(BenchConfig.model_validate_json(BenchConfig().model_dump_json()).rate)


# --------------------------------------------------------------------------- result file

def test_result_file_shape_and_figure(tmp_path):
    recs = [request_record(0.1 * i, [0.1 * i + 0.2, 0.1 * i + 0.25, 0.1 * i + 0.3],
                           output_tokens=3, prompt_tokens=4, start_s=0.1 * i)
            for i in range(10)]
    summary = summarize(recs, Slo(ttft_ms=150), 1.3)
    result = make_result({"bench": {"rate": float("inf")}, "slo": {}}, summary, recs,
                         simulated=True)
    json_path, png_path = write_result(result, tmp_path, "sim-x")
    doc = json.loads(json_path.read_text())  # strict JSON: inf became a string
    assert list(doc)[:4] == ["config", "simulated", "summary", "requests"]
    assert doc["simulated"] is True and doc["config"]["bench"]["rate"] == "inf"
    for key in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "prompt_tokens", "output_tokens",
                "ok"):
        assert key in doc["requests"][0]
    assert png_path == tmp_path / "sim-x.png" and png_path.stat().st_size > 10_000
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # records without start times still plot (the time panel says so)
    bare = [dict(r.to_dict(), start_s=None) for r in recs]
    plot_serve_result(make_result({}, summary, bare), tmp_path / "bare.png")
    assert (tmp_path / "bare.png").exists()
