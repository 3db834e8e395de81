"""scheduler.slo_admission=reject over HTTP: a request predicted to miss its SLO is answered
429 with OpenAI's error body and the reason (streamed: the same body as an event), and counted
on /metrics."""
from __future__ import annotations

import httpx
import pytest
from helpers.server_process import SERVER_THREADS, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # a TTFT of 1 µs: every request is predicted to miss it
    with ServerProcess(tiny_model_dir("llama"), SERVER_THREADS, "scheduler=slo",
                       "slo.ttft_ms=0.001", "scheduler.slo_admission=reject",
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


def test_rejected_request_is_429_with_the_reason(server, model):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": "hello there", "max_tokens": 4})
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") == "1"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "slo_rejected" and err["type"] == "requests"
    assert "predicted TTFT" in err["message"] and "slo.ttft_ms=0.001" in err["message"]


def test_streamed_rejection_is_an_error_event(server, model):
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": model, "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:
        body = "".join(r.iter_text())
    assert '"code": "slo_rejected"' in body and body.rstrip().endswith("data: [DONE]")


def test_rejections_are_counted_on_metrics(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines()
                if ln.startswith("llmkit:slo_rejected_requests_total{"))
    assert float(line.rsplit(" ", 1)[1]) >= 2  # the two requests above
    assert any(ln.startswith("llmkit:slo_deferred_requests_total{") for ln in text.splitlines())
