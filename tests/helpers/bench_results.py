"""The bench tests' check of a result file: its summary agrees with its per-request records."""
from __future__ import annotations

import pytest


def check_result_consistency(doc: dict, expected_requests: int) -> None:
    """The summary agrees with the per-request records (the contract's shape)."""
    assert list(doc)[:4] == ["config", "simulated", "summary", "requests"]
    assert doc["simulated"] is False
    s, recs = doc["summary"], doc["requests"]
    assert s["num_requests"] == len(recs) == expected_requests
    done = [r for r in recs if r["ok"]]
    assert s["completed"] == len(done) and s["failed"] == len(recs) - len(done)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert s["request_throughput"] == pytest.approx(len(done) / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["goodput"] <= s["request_throughput"] + 1e-9
    for r in recs:
        assert set(r) >= {"ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "prompt_tokens",
                          "output_tokens", "ok"}
    for m in ("ttft_ms", "e2el_ms", "tpot_ms"):
        values = sorted(r[m] for r in done if r[m] is not None)
        st = s[m]
        assert values[0] <= st["p50"] <= st["p90"] <= st["p99"] <= values[-1]
        assert st["mean"] == pytest.approx(sum(values) / len(values))
    itl = sorted(x for r in done for x in r["itl_ms"])
    assert itl[0] <= s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] <= itl[-1]
    for r in done:
        assert r["e2el_ms"] >= r["ttft_ms"]
        if r["output_tokens"] > 1:
            assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"])
                                                 / (r["output_tokens"] - 1))
