"""``llmkit bench serve`` against a live ``llmkit serve`` of a tiny model (a subprocess on a
free port): the result JSON agrees with its per-request records, every request got exactly
its ``max_tokens`` (ignore_eos) for exactly the prompt ids sent, a PNG is written, and the
server's engine writes its step trace (``observability.trace_file``) when it stops."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from helpers.bench_results import check_result_consistency
from helpers.server_process import ServerProcess

from llmkit.entrypoints import cli
from llmkit.tools.bench.datasets import build_workload
from llmkit.tools.compose import compose_tool_config
from llmkit.tools.schema import BenchToolConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("live")
    trace = tmp / "engine-trace.json"
    server = ServerProcess(model, "kv_cache.num_blocks=256", f"observability.trace_file={trace}",
                           log_path=tmp / "server.log")
    try:
        # while the server starts: the imports the bench command will need
        from llmkit.models.loader import resolve_model_source  # noqa: F401
        from llmkit.tools.bench.results import _pyplot
        _pyplot()
        server.wait_ready(timeout=180)
        yield {"url": server.base_url, "model": model, "proc": server.proc, "trace": trace,
               "tmp": tmp}
    finally:
        server.stop()


def test_bench_serve_against_live_server(live, tmp_path, capsys):
    args = [f"bench.base_url={live['url']}", "bench.num_requests=6", "bench.rate=inf",
            "bench.input_len=16", "bench.output_len=6", "bench.range_ratio=0.5",
            "bench.max_concurrency=4", "slo.ttft_ms=60000", "bench.seed=2"]
    rc = cli.main(["bench", "serve", str(live["model"]), *args, f"bench.output_dir={tmp_path}",
                   "bench.result_name=live", "bench.progress=false"])
    assert rc == 0, capsys.readouterr().err
    assert "Serving Benchmark Result" in capsys.readouterr().out
    doc = json.loads((tmp_path / "live.json").read_text())
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    check_result_consistency(doc, expected_requests=6)
    assert doc["summary"]["completed"] == 6
    # the same workload, rebuilt: the server saw these exact prompt ids and lengths
    tok_cfg = compose_tool_config(BenchToolConfig, [f"model.path={live['model']}", *args]).bench
    from transformers import AutoTokenizer
    workload = build_workload(tok_cfg, AutoTokenizer.from_pretrained(str(live["model"])))
    recs = {r["request_id"]: r for r in doc["requests"]}
    for w in workload:
        r = recs[w.request_id]
        assert r["prompt_tokens"] == w.prompt_len
        assert r["output_tokens"] == w.max_tokens  # ignore_eos: exactly max_tokens
        assert len(r["itl_ms"]) == r["output_tokens"] - 1  # one ITL per token after the first
    # no SLO is violated at 60 s: goodput equals request throughput
    assert doc["summary"]["goodput"] == pytest.approx(doc["summary"]["request_throughput"])


def test_server_engine_writes_step_trace_on_shutdown(live):
    proc = live["proc"]
    # make sure the engine ran some steps (the previous test may have been deselected)
    body = {"model": str(live["model"]), "prompt": [5, 6, 7], "max_tokens": 3,
            "ignore_eos": True}
    assert httpx.post(f"{live['url']}/v1/completions", json=body, timeout=60,
                      trust_env=False).status_code == 200
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    deadline = time.monotonic() + 30
    while not live["trace"].exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    doc = json.loads(live["trace"].read_text())
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert steps and doc["otherData"]["steps"] == len(steps)
    assert sum(e["args"]["decode_tokens"] for e in steps) >= 2
