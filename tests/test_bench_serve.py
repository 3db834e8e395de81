"""The streaming load generator against a fake OpenAI-compatible server with known delays
(tests/helpers/fake_openai_server.py), and ``llmkit bench serve`` / ``bench plot`` end to end.

Timing checks use only lower bounds that the fake server's sleeps guarantee, plus loose upper
bounds; no test claims a precise duration.
"""
from __future__ import annotations

import json
import math

import pytest

from helpers.bench_results import check_result_consistency
from helpers.fake_openai_server import EMPTY_TOKEN, FAIL_TOKEN, FakeServer

from llmkit.entrypoints import cli
from llmkit.tools.bench.client import ClientOptions, run_load_sync
from llmkit.tools.bench.datasets import WorkloadRequest
from llmkit.tools.bench.metrics import summarize

FIRST, GAP = 0.1, 0.02  # the fake server's delays (s)
SLACK_MS = 2000  # loose upper bound on what a busy 2-core machine adds


def workload(n: int, max_tokens: int = 5, gap_s: float = 0.0, prompt_len: int = 3):
    return [WorkloadRequest(f"r{i}", max_tokens, arrival_s=i * gap_s,
                            prompt_token_ids=[10 + i] * prompt_len, prompt_len=prompt_len)
            for i in range(n)]


def opts(server, **kw):
    kw.setdefault("progress", False)
    return ClientOptions(base_url=server.url, **kw)


@pytest.fixture(scope="module")
def fake():
    with FakeServer(first_delay_s=FIRST, gap_s=GAP) as server:
        yield server


def test_client_timestamps_match_known_delays(fake):
    res = run_load_sync(workload(4, max_tokens=5, gap_s=0.05), opts(fake))
    assert res.model == "fake-model" and res.num_unsent == 0 and len(res.records) == 4
    for rec in res.records:
        assert rec.ok and rec.output_tokens == 5 and rec.prompt_tokens == 3
        assert 1e3 * FIRST <= rec.ttft_ms < 1e3 * FIRST + SLACK_MS
        # the last token left the server >= FIRST + 4 * GAP after it got the request
        assert 1e3 * (FIRST + 4 * GAP) <= rec.e2el_ms < 1e3 * (FIRST + 4 * GAP) + SLACK_MS
        # one ITL per chunk after the first; they add up to the first-to-last chunk time
        assert len(rec.itl_ms) == 4 and all(x >= 0 for x in rec.itl_ms)
        assert rec.ttft_ms + sum(rec.itl_ms) <= rec.e2el_ms + 1e-6
        assert rec.tpot_ms == pytest.approx((rec.e2el_ms - rec.ttft_ms) / 4)
    # arrivals were honoured: sends are at least 50 ms apart
    starts = [r.start_s for r in res.records]
    assert all(b - a >= 0.045 for a, b in zip(starts, starts[1:]))
    # what the server received: token-id prompts, ignore_eos, streaming with usage
    body = fake.state.requests[-1]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert isinstance(body["prompt"], list) and body["max_tokens"] == 5


def test_warmup_requests_are_sent_first_untimed_and_share_no_prefix(fake):
    """bench.warmup_requests: sent one by one before the run and left out of the records;
    their prompts are the first one's reversed, so no timed request finds them cached."""
    before = len(fake.state.requests)
    reqs = workload(3, max_tokens=4)
    reqs[0].prompt_token_ids = [5, 6, 7]
    res = run_load_sync(reqs, opts(fake, warmup_requests=2))
    assert len(res.records) == 3 and all(r.ok for r in res.records)
    assert [r.request_id for r in res.records] == ["r0", "r1", "r2"]
    sent = fake.state.requests[before:]
    assert len(sent) == 5
    assert [b["prompt"] for b in sent[:2]] == [[7, 6, 5], [6, 5, 7]]
    assert all(b["max_tokens"] == 2 for b in sent[:2])
    assert sorted(map(tuple, (b["prompt"] for b in sent[2:]))) == [(5, 6, 7), (11, 11, 11),
                                                                   (12, 12, 12)]


def test_tokens_without_text_still_count(fake):
    """Tokens whose text is empty (skipped special tokens) arrive with the final chunk, which
    has no text but a finish_reason: the request is ok, its token count is the server's, and
    its first output is that final chunk."""
    reqs = workload(1, max_tokens=4)
    reqs[0].prompt_token_ids = [EMPTY_TOKEN, 1, 2]
    rec = run_load_sync(reqs, opts(fake)).records[0]
    # all four came in one chunk: the three after the first have an ITL of 0
    assert rec.ok and rec.output_tokens == 4 and rec.itl_ms == [0.0, 0.0, 0.0]
    assert rec.ttft_ms >= 1e3 * (FIRST + 3 * GAP)
    assert rec.tpot_ms == pytest.approx((rec.e2el_ms - rec.ttft_ms) / 3)


@pytest.mark.parametrize("continuous_usage", [True, False])
def test_itl_has_one_entry_per_token_when_chunks_carry_several(continuous_usage):
    """A busy server packs several tokens into one chunk: ITL still has output_tokens - 1
    entries, each chunk's gap split evenly over its tokens (counted from the usage on every
    chunk; without it, one token a chunk and the rest on the last one)."""
    with FakeServer(first_delay_s=FIRST, gap_s=GAP, tokens_per_chunk=3,
                    continuous_usage=continuous_usage) as server:
        rec = run_load_sync(workload(1, max_tokens=7), opts(server)).records[0]
    # chunks: tokens 0-2 (at FIRST + 2 GAP), 3-5 (+ 3 GAP), 6 (+ 1 GAP)
    assert rec.ok and rec.output_tokens == 7
    assert len(rec.itl_ms) == rec.output_tokens - 1
    # The ITLs span the first to the last token's chunk; TPOT also spans the stream's end.
    assert 4 * GAP * 1e3 <= sum(rec.itl_ms) <= rec.tpot_ms * 6 + 1e-6  # chunks 2 and 3: 3 + 1 GAP
    if continuous_usage:
        assert rec.itl_ms[:2] == [0.0, 0.0]  # arrived with the first token
        second, third = rec.itl_ms[2:5], rec.itl_ms[5:]
        assert len(set(second)) == 1 and second[0] >= 1e3 * GAP  # 3 GAP over 3 tokens
        assert len(third) == 1 and third[0] >= 1e3 * GAP
    else:  # three chunks of one token each, the other four tokens on the last chunk
        assert rec.itl_ms[0] >= 3e3 * GAP and rec.itl_ms[1:] == [rec.itl_ms[1]] * 5


def test_ttft_includes_server_queueing():
    """A server that serves one request at a time: three requests sent together wait in its
    queue, so the k-th TTFT includes the k - 1 services before it."""
    service = FIRST + 3 * GAP  # 4 tokens
    with FakeServer(first_delay_s=FIRST, gap_s=GAP, serial=True) as server:
        res = run_load_sync(workload(3, max_tokens=4), opts(server))
    ttfts = sorted(r.ttft_ms for r in res.records)
    for k, ttft in enumerate(ttfts):
        assert ttft >= 1e3 * (k * service + FIRST) * 0.95
    assert all(r.queue_ms < 1000 for r in res.records)  # no client-side wait here


def test_concurrency_cap_errors_and_goodput(fake):
    reqs = workload(6, max_tokens=3)
    reqs[2].prompt_token_ids = [FAIL_TOKEN, 1, 2]
    fake.state.max_inflight = 0
    res = run_load_sync(reqs, opts(fake, max_concurrency=2))
    assert fake.state.max_inflight <= 2
    failed = [r for r in res.records if not r.ok]
    assert len(failed) == 1 and failed[0].request_id == "r2"
    assert failed[0].error.startswith("HTTP 400: this prompt is refused")
    # with a cap of 2, later requests wait on the client side before being sent
    assert max(r.queue_ms for r in res.records) >= 1e3 * FIRST * 0.9
    s = summarize(res.records, {"ttft_ms": 1e3 * FIRST + SLACK_MS}, res.duration_s)
    assert s["completed"] == 5 and s["failed"] == 1
    assert s["goodput"] == pytest.approx(5 / res.duration_s)
    strict = summarize(res.records, {"ttft_ms": 1e3 * FIRST * 0.5}, res.duration_s)
    assert strict["goodput"] == 0.0


def test_time_limit_drops_unsent_and_cancels_in_flight(fake):
    # requests every 0.3 s, each taking >= 0.1 + 49 * 0.02 s; stop after 0.5 s
    reqs = workload(10, max_tokens=50, gap_s=0.3)
    res = run_load_sync(reqs, opts(fake, max_duration_s=0.5))
    # arrivals at 0 and 0.3 s are sent (the second one unless the machine stalls for 0.2 s)
    assert 1 <= len(res.records) <= 2 and res.num_unsent == 10 - len(res.records)
    assert all(not r.ok and r.error.startswith("cancelled") for r in res.records)
    assert res.duration_s < 0.5 + SLACK_MS / 1e3


def test_bench_serve_cli_writes_consistent_json_and_png(fake, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["bench", "serve", str(tiny_model_dir("llama")), f"bench.base_url={fake.url}",
                   "bench.num_requests=12", "bench.rate=50", "bench.input_len=8",
                   "bench.output_len=4", "bench.range_ratio=0.5", "slo.ttft_ms=5000",
                   "slo.tpot_ms=5000", f"bench.output_dir={out}", "bench.result_name=run",
                   "bench.progress=false"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Goodput (req/s):" in printed
    doc = json.loads((out / "run.json").read_text())
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"
    check_result_consistency(doc, expected_requests=12)
    assert doc["config"]["served_model"] == "fake-model"
    assert doc["config"]["bench"]["rate"] == 50 and doc["config"]["slo"]["ttft_ms"] == 5000
    # output lengths follow the workload: 4 * [0.5, 1.5] = 2..6, and the server honoured them
    assert all(2 <= r["output_tokens"] <= 6 for r in doc["requests"])


def test_multirun_sweep_and_plot(fake, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = cli.main(["bench", "serve", str(tiny_model_dir("llama")), "-m",
                   "bench.rate=20,inf", f"bench.base_url={fake.url}", "bench.num_requests=4",
                   "bench.input_len=4", "bench.output_len=3", f"bench.output_dir={out}",
                   "slo.ttft_ms=4000", "bench.progress=false"])
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["serve-bench.rate=20.json", "serve-bench.rate=20.png",
                     "serve-bench.rate=inf.json", "serve-bench.rate=inf.png"]
    doc = json.loads((out / "serve-bench.rate=20.json").read_text())
    assert doc["config"]["sweep"] == {"bench.rate": 20}
    check_result_consistency(doc, expected_requests=4)
    capsys.readouterr()
    assert cli.main(["bench", "plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "goodput (req/s)" in printed and "bench.rate=20" in printed
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_are_one_line(tiny_model_dir, tmp_path, capsys):
    model = str(tiny_model_dir("llama"))
    cases = [
        (["bench"], 2, "bench needs a sub-command"),
        (["bench", "serve", model, "bench.base_url=http://127.0.0.1:9", "bench.num_requests=1",
          "bench.progress=false"], 1, "cannot reach the server"),
        (["bench", "serve", model, "bench.dataset=jsonl"], 2, "bench.dataset_path"),
        (["bench", "serve", model, "bench.dataset=jsonl",
          f"bench.dataset_path={tmp_path}/none.jsonl"], 2, "does not exist"),
        (["bench", "plot", str(tmp_path)], 2, "no benchmark results"),
        (["bench", "serve", model, "bench.rate=0"], 2, "bench.rate"),
    ]
    for argv, code, fragment in cases:
        assert cli.main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.startswith("llmkit: error: ") and fragment in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_chat_endpoint_needs_text_and_streams_deltas(fake):
    reqs = workload(1)
    reqs[0].prompt = "hello there"
    # the fake server has no chat route: a 404 is a failed record, not a crash
    res = run_load_sync(reqs, opts(fake, endpoint="chat"))
    assert not res.records[0].ok and "HTTP 404" in res.records[0].error
    with pytest.raises(ValueError, match="text prompts"):
        run_load_sync(workload(1), opts(fake, endpoint="chat"))
    assert math.isfinite(res.duration_s)
