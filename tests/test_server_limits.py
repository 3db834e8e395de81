"""The server's limits and failures: API key (401), a full queue (503 + Retry-After), the
engine process dying (in-flight requests fail with 500, /health 503 within 5 s, no hang), and
shutdown after that. One server for the module (one running sequence at a time, at most two
waiting); the engine-death tests run last. The server also runs with a generation config of its
own (``model.generation_config=PATH``: ``top_k=1``), which greedy requests do not notice."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from helpers.processes import paused, pid_alive, wait_for
from helpers.server_process import PROMPT, SERVER_THREADS, ServerProcess, error_body

API_KEY = "sekret-123"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    gen_config = tmp / "generation_config.json"
    gen_config.write_text(json.dumps({"top_k": 1, "eos_token_id": 2}))
    with ServerProcess(tiny_model_dir("llama"), f"server.api_key={API_KEY}",
                       "scheduler.max_num_seqs=1", "server.max_waiting_requests=2",
                       "server.shutdown_timeout=3", "kv_cache.num_blocks=128", SERVER_THREADS,
                       f"model.generation_config={gen_config}",
                       log_path=tmp / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=API_KEY)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def long_stream(client, model, max_tokens=480):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def wait_idle(server, timeout=10.0):
    def idle():
        m = server.metrics()
        return m["llmkit:num_requests_running"] == 0 and m["llmkit:num_requests_waiting"] == 0 \
            and m["llmkit:kv_cache_usage_perc"] == 0
    assert wait_for(idle, timeout), server.metrics()


# --------------------------------------------------------------------------- start-up

def test_busy_port_fails_fast_with_one_line(server, capsys):
    """The port is bound before the engine starts: a second server on the same port exits
    with 2 and one line, without loading the model."""
    from llmkit.entrypoints import cli

    model_dir = server.proc.args[4]
    capsys.readouterr()
    start = time.monotonic()
    assert cli.main(["serve", model_dir, f"server.port={server.port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: server.port: cannot listen on") and \
        err.count("\n") == 1, err
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------- 401

def test_api_key_is_required(server, client, model):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").completions.create(model=model, prompt="hi")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"messages": []}),
                               ("POST", "/tokenize", {"prompt": "hi"})]:
        resp = httpx.request(method, server.url(path), json=body)
        assert resp.status_code == 401, (path, resp.text)
        err = error_body(resp)
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    resp = httpx.get(server.url("/v1/models"), headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401
    # with the key
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices
    assert httpx.post(server.url("/tokenize"), json={"prompt": "hi"},
                      headers=AUTH).status_code == 200
    # health, metrics and docs stay open
    for path in ("/health", "/metrics", "/docs"):
        assert httpx.get(server.url(path)).status_code == 200, path
    script = re.search(r'<script src="([^"]+)"', httpx.get(server.url("/docs")).text).group(1)
    assert httpx.get(server.url(script)).status_code == 200  # /docs' own assets too
    assert server.metrics()['llmkit:http_request_errors_total{model_name="%s",status="401"}'
                            % model] >= 5


def test_api_key_from_environment(monkeypatch):
    from llmkit.config.compose import build_config
    from llmkit.entrypoints.serve import API_KEY_ENV, resolve_api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = build_config("smollm2-135m-instruct")
    assert resolve_api_key(cfg) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(cfg) == "from-env"
    cfg = build_config("smollm2-135m-instruct", overrides=["server.api_key=from-config"])
    assert resolve_api_key(cfg) == "from-config"


# --------------------------------------------------------------------------- 503

def test_full_queue_is_503_with_retry_after(server, client, model):
    """One sequence runs (scheduler.max_num_seqs=1); two more wait for their first token
    (server.max_waiting_requests=2); the next request is refused with 503 until they drain."""
    for attempt in range(3):
        running = long_stream(client, model)
        next(iter(running))  # its first token arrived: it runs
        waiting = [long_stream(client, model, 8) for _ in range(2)]
        resp = httpx.post(server.url("/v1/completions"), headers=AUTH,
                          json={"model": model, "prompt": "hi", "max_tokens": 2})
        if resp.status_code == 503:
            break
        # Only acceptable if the long request had already finished (a very fast box): retry.
        rest = list(running)
        assert rest and rest[-1].choices[0].finish_reason == "length", resp.text
        for w in waiting:
            list(w)
    else:
        pytest.fail("the running request always finished before the queue filled")
    assert resp.headers["Retry-After"] == "1"
    err = error_body(resp)
    assert err["code"] == "overloaded" and "max_waiting_requests" in err["message"]
    with pytest.raises(openai.APIStatusError) as e:  # the openai client sees it too
        client.chat.completions.create(model=model, messages=[{"role": "user",
                                                               "content": "hi"}])
    assert e.value.status_code == 503
    # The waiting ones get their turn and finish; then there is room again.
    running.close()
    for w in waiting:
        chunks = list(w)
        assert chunks[-1].choices[0].finish_reason == "length"
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices
    wait_idle(server)
    m = server.metrics()
    assert m[f'llmkit:http_request_errors_total{{model_name="{model}",status="503"}}'] >= 2


# --------------------------------------------------------------------------- model defaults

def test_model_sampling_defaults_fill_unset_fields(server, client, model):
    """vLLM's rule: a field the request leaves unset takes the model's generation config
    (here top_k=1: sampling from the single most likely token, i.e. greedy), a field it sets
    keeps its value; the start-up log says which defaults are in force."""
    assert "sampling defaults from the model" in server.log() and "top_k=1" in server.log()

    def text(top_k=None, **fields):
        extra = {"ignore_eos": True, **({} if top_k is None else {"top_k": top_k})}
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                         extra_body=extra, **fields).choices[0].text

    greedy = text(temperature=0)
    sampled = {seed: text(temperature=1.0, seed=seed) for seed in (1, 2, 3)}
    assert set(sampled.values()) == {greedy}  # top_k=1 from the model's defaults
    # The same seeds with top_k set (0 = off) sample for real: the defaults did the above.
    unrestricted = {seed: text(temperature=1.0, seed=seed, top_k=0) for seed in (1, 2, 3)}
    assert set(unrestricted.values()) != {greedy}, unrestricted


def test_engine_process_starts_with_the_wait_policy(server):
    """The engine-core process started with the OpenMP wait policy that ``llmkit serve`` set
    before torch loaded (unless the environment had one), and logged it."""
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        assert "OpenMP: GOMP_SPINCOUNT=1000" in server.log()


# --------------------------------------------------------------------------- engine death (last)

def test_engine_death_fails_requests_and_health(server, client, model):
    engine_pid = server.engine_pid

    def num_waiting_for_first_token() -> int:
        """The API process's count of requests without a first token, read without side
        effects: n=3 samples exceed server.max_waiting_requests=2 whatever the count, so the
        request is refused (nothing admitted) with a 503 whose message gives the count."""
        resp = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=10,
                          json={"model": model, "prompt": "hi", "max_tokens": 1, "n": 3})
        assert resp.status_code == 503, resp.text
        message = error_body(resp)["message"]
        return int(re.search(r"(\d+) requests wait for their first token", message).group(1))

    # Both in flight: the stream runs (max_num_seqs=1), the plain request waits. The engine
    # core is frozen (SIGSTOP) as soon as the stream's first token is here, so neither
    # finishes before the kill, however fast the CPU; no sleep. (A stopped process can still
    # be SIGKILLed; it is resumed if the test fails before that.)
    stream = long_stream(client, model)
    next(iter(stream))
    with concurrent.futures.ThreadPoolExecutor(1) as pool, paused(engine_pid):
        pending = pool.submit(client.completions.create, model=model, prompt=PROMPT,
                              max_tokens=200)
        # admitted: the server counts it among the requests waiting for their first token
        assert wait_for(lambda: num_waiting_for_first_token() == 1, 10)
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(server.url("/health")).status_code == 503, 5)
        assert time.monotonic() - killed_at < 5
        with pytest.raises(openai.InternalServerError) as e:
            pending.result(timeout=10)
        assert e.value.body["code"] == "engine_dead"
    with pytest.raises(openai.APIError):  # the stream ends with an error event
        list(stream)
    health = httpx.get(server.url("/health"))
    assert health.status_code == 503 and error_body(health)["code"] == "engine_dead"
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert time.monotonic() - start < 5
    assert server.metrics()["llmkit:engine_up"] == 0
    assert not pid_alive(engine_pid)


def test_sigterm_after_engine_death_exits_cleanly(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(20) == 0
