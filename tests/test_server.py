"""The OpenAI-compatible server, end to end: ``llmkit serve`` started by the test on 127.0.0.1
with a tiny model, called with the official ``openai`` client (and httpx for raw bodies).
One server for the module; results are compared with the offline ``LLM`` on the same model.

The last test stops the server with SIGTERM (graceful shutdown). The harness that starts the
server is ``tests/helpers/server_process.py``.
"""
from __future__ import annotations

import asyncio
import re
import signal

import httpx
import openai
import pytest

from helpers.processes import paused, pid_alive, wait_for
from helpers.server_process import PROMPT, SERVER_THREADS, ServerProcess, error_body

from llmkit import LLM, SamplingParams

# --------------------------------------------------------------------------- fixtures


class Env:
    server: ServerProcess
    offline: LLM
    model: str


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    import torch

    model_dir = tiny_model_dir("llama")
    server = ServerProcess(model_dir, "kv_cache.num_blocks=512", SERVER_THREADS,
                           log_path=tmp_path_factory.mktemp("server") / "server.log")
    e = Env()
    e.server = server
    threads = torch.get_num_threads()
    try:
        # Built while the server starts.
        e.offline = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 512},
                        platform={"num_threads": 1})
        server.wait_ready()
        e.model = server.client().models.list().data[0].id
        yield e
    finally:
        server.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(env):
    return env.server.client()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def offline_text(env, prompt, params: SamplingParams) -> tuple[str, list[int]]:
    out = env.offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


MESSAGES = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What is the capital of France?"}]


# --------------------------------------------------------------------------- basics

def test_models_health_docs(env, client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == env.model
    assert httpx.get(env.server.url("/health")).status_code == 200
    paths = httpx.get(env.server.url("/openapi.json")).json()["paths"]
    for p in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
              "/detokenize", "/health", "/metrics"):
        assert p in paths
    # the start-up line names the pages a browser opens, and each is there
    base = env.server.base_url
    line = next(ln for ln in env.server.log().splitlines() if "engine core process pid=" in ln)
    for page in ("/", "/engine", "/docs"):
        assert f"{base}{page}," in line or f"{base}{page})" in line, line
        assert httpx.get(env.server.url(page)).status_code == 200, page


def test_startup_line_names_the_pages():
    from llmkit.entrypoints.serve import startup_line

    line = startup_line([41, 42], "m", "::1", 8000)
    assert line.startswith("engine core process pids 41,42; serving m on http://[::1]:8000 ")
    assert line.endswith("(chat page http://[::1]:8000/, engine view http://[::1]:8000/engine, "
                         "API docs http://[::1]:8000/docs)")
    assert "pid=7;" in startup_line([7], "m", "127.0.0.1", 1)


def test_lora_routes_absent_without_runtime_updates(env):
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        resp = httpx.post(env.server.url(route), json={"lora_name": "a", "lora_path": "/tmp"})
        assert resp.status_code == 404 and error_body(resp)["code"] == "not_found"


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_need_no_network(env, page):
    """Swagger UI / ReDoc: every script, style sheet and icon the page loads comes from this
    server (a CDN would leave a blank page offline), and the server serves them."""
    resp = httpx.get(env.server.url(page))
    assert resp.status_code == 200 and "text/html" in resp.headers["content-type"]
    html = resp.text
    assert "://" not in html, [line for line in html.splitlines() if "://" in line]
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    kinds = {a.rsplit(".", 1)[-1] for a in assets}
    assert {"js", "png"} <= kinds and (page == "/redoc" or "css" in kinds), assets
    for asset in assets:
        assert asset.startswith("/"), asset
        got = httpx.get(env.server.url(asset))
        assert got.status_code == 200 and len(got.content) > 1000, asset
    if page == "/docs":
        assert "url: '/openapi.json'" in html


def test_completion_matches_offline_with_usage(env, client):
    tok = env.offline.get_tokenizer()
    text, ids = offline_text(env, PROMPT, greedy(16))
    resp = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=16,
                                     temperature=0)
    assert resp.object == "text_completion" and len(resp.choices) == 1
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason == ("length" if len(ids) == 16 else "stop")
    assert resp.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert resp.usage.completion_tokens == len(ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(ids)


def test_completion_stream_with_usage(env, client):
    text, ids = offline_text(env, PROMPT, greedy(16))
    chunks = list(client.completions.create(model=env.model, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(env.offline.get_tokenizer().encode(PROMPT))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_count_every_chunk(env, endpoint):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far, whose
    growth is the tokens that chunk carried (the load generator counts ITLs with it)."""
    import json

    body = {"model": env.model, "max_tokens": 12, "temperature": 0, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if endpoint == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = PROMPT
    with httpx.stream("POST", env.server.url(f"/v1/{'chat/' if endpoint == 'chat' else ''}"
                                             "completions"), json=body, timeout=60) as resp:
        chunks = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    output = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                     c["choices"][0].get("delta", {}).get(
                                                         "content")
                                                     or c["choices"][0].get("finish_reason"))]
    assert output and all("usage" in c for c in output)
    so_far = [c["usage"]["completion_tokens"] for c in output]
    assert so_far == sorted(so_far) and so_far[-1] == 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_completion_prompt_forms(env, client):
    tok = env.offline.get_tokenizer()
    ids = tok.encode(PROMPT)
    text, _ = offline_text(env, PROMPT, greedy(8))
    by_ids = client.completions.create(model=env.model, prompt=ids, max_tokens=8,
                                       temperature=0)
    assert by_ids.choices[0].text == text
    batch = client.completions.create(model=env.model, prompt=[PROMPT, "Hello there"],
                                      max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text
    assert batch.choices[1].text == offline_text(env, "Hello there", greedy(8))[0]
    assert batch.usage.prompt_tokens == len(ids) + len(tok.encode("Hello there"))


def test_chat_matches_offline_streamed_and_not(env, client):
    tok = env.offline.get_tokenizer()
    expected = env.offline.chat(MESSAGES, greedy(16), use_tqdm=False)[0].outputs[0]
    resp = client.chat.completions.create(model=env.model, messages=MESSAGES, max_tokens=16,
                                          temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    prompt_ids = env.offline.apply_chat_template(MESSAGES)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(
        model=env.model, messages=MESSAGES, max_completion_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == expected.text
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # /tokenize with messages counts what the chat template makes
    tokenized = httpx.post(env.server.url("/tokenize"), json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == prompt_ids and tokenized["count"] == len(prompt_ids)
    del tok


def test_n2_same_samples_as_offline(env, client):
    """Depends on the sampling work (n > 1 fan-out with seeds seed + i)."""
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12)
    expected = env.offline.generate([PROMPT], params, use_tqdm=False)[0].outputs
    resp = client.completions.create(model=env.model, prompt=PROMPT, n=2, temperature=1.0,
                                     seed=7, max_tokens=12)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for c in resp.choices:
        assert c.text == expected[c.index].text
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    chunks = list(client.chat.completions.create(model=env.model, messages=MESSAGES, n=2,
                                                 temperature=1.0, seed=7, max_tokens=12,
                                                 stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    want = env.offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs
    assert texts == {0: want[0].text, 1: want[1].text}


def test_seed_reproducible(env, client):
    def sample(seed):
        return client.completions.create(model=env.model, prompt=PROMPT, temperature=1.0,
                                         max_tokens=16, seed=seed).choices[0].text

    first = sample(123)
    assert sample(123) == first
    assert first == offline_text(env, PROMPT, SamplingParams(temperature=1.0, max_tokens=16,
                                                             seed=123))[0]
    assert len({first, sample(1), sample(2), sample(3)}) > 1


def test_logprobs(env, client):
    """Depends on the sampling work (logprobs in the outputs)."""
    resp = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the best one was chosen
    chat = client.chat.completions.create(model=env.model, messages=MESSAGES, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    streamed = list(client.completions.create(model=env.model, prompt=PROMPT, max_tokens=6,
                                              temperature=0, logprobs=3, stream=True))
    toks = [t for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.token_logprobs]
    assert toks == pytest.approx(lp.token_logprobs)


def test_stop_strings(env, client):
    """Depends on the sampling work (stop strings in the output processor)."""
    full = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    starts = [i for i in range(3, len(full) - 3) if "\ufffd" not in full[i:i + 3]
              and full[i:i + 3].strip()]
    assert starts, full
    stop = full[starts[0]:starts[0] + 3]
    cut = full.index(stop)
    resp = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=24,
                                     temperature=0, stop=[stop, "\x00never"])
    assert resp.choices[0].text == full[:cut]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
        if c.choices)
    assert streamed == full[:cut]


def test_sampling_extras_pass_through(env, client):
    """vLLM's extras and penalties reach SamplingParams (depends on the sampling work)."""
    tok = env.offline.get_tokenizer()
    greedy_text = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=8,
                                            temperature=0).choices[0].text
    first = tok.encode(greedy_text)[0]
    biased = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=8,
                                       temperature=0, logit_bias={str(first): -100})
    assert not biased.choices[0].text.startswith(tok.decode([first]))
    resp = client.completions.create(
        model=env.model, prompt=PROMPT, max_tokens=8, temperature=0.8, presence_penalty=0.5,
        frequency_penalty=0.5, user="u1",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 8, "priority": 1})
    assert resp.usage.completion_tokens == 8


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
])
def test_invalid_completion_requests_are_400(env, body, param):
    resp = httpx.post(env.server.url("/v1/completions"), json={"model": env.model, **body})
    assert resp.status_code == 400, resp.text
    err = error_body(resp)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_bad_json_and_bad_chat_are_400(env):
    url = env.server.url("/v1/chat/completions")
    resp = httpx.post(url, content=b'{"messages": [', headers={"content-type":
                                                               "application/json"})
    assert resp.status_code == 400 and "JSON" in error_body(resp)["message"]
    for body, param in [({"messages": []}, "messages"),
                        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
                        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": MESSAGES, "max_completion_tokens": -1},
                         "max_completion_tokens")]:
        resp = httpx.post(url, json=body)
        assert resp.status_code == 400, resp.text
        assert error_body(resp)["param"] == param
    # a turn without content, as OpenAI and vLLM answer it (issue 31.10); an assistant turn
    # may leave it null only when it calls tools (the tool-history tests send that, answered)
    for message in ({"role": "user", "content": None}, {"role": "user"},
                    {"role": "system", "content": None}, {"role": "tool", "tool_call_id": "c"},
                    {"role": "assistant", "content": None}):
        resp = httpx.post(url, json={"messages": [message]})
        assert resp.status_code == 400, (message, resp.text)
        err = error_body(resp)
        assert err["param"] == "messages" and "needs content" in err["message"], err


def test_prompt_too_long_is_400_and_others_still_served(env, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=env.model, prompt=[5] * 600, max_tokens=4)
    assert "maximum context length" in e.value.body["message"]
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # fits alone, not with the completion
        client.completions.create(model=env.model, prompt=[5] * 500, max_tokens=100)
    assert e.value.body["param"] == "max_tokens"
    long_chat = [{"role": "user", "content": "hello " * 600}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=env.model, messages=long_chat)
    ok = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=4)
    assert ok.usage.completion_tokens > 0


def test_unknown_model_is_404(env, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    resp = httpx.post(env.server.url("/v1/chat/completions"),
                      json={"model": "gpt-nope", "messages": MESSAGES})
    assert resp.status_code == 404 and error_body(resp)["code"] == "model_not_found"
    assert httpx.get(env.server.url("/v1/nothing")).status_code == 404


def test_tokenize_detokenize(env):
    tok = env.offline.get_tokenizer()
    resp = httpx.post(env.server.url("/tokenize"), json={"prompt": PROMPT}).json()
    assert resp["tokens"] == tok.encode(PROMPT) and resp["count"] == len(resp["tokens"])
    assert resp["max_model_len"] == env.offline.max_model_len
    back = httpx.post(env.server.url("/detokenize"), json={"tokens": resp["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    bad = httpx.post(env.server.url("/detokenize"), json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and error_body(bad)["param"] == "tokens"


# --------------------------------------------------------------------------- load

EXPECTED_METRICS = [
    "llmkit:time_to_first_token_seconds_count", "llmkit:inter_token_latency_seconds_count",
    "llmkit:e2e_request_latency_seconds_count", "llmkit:request_queue_time_seconds_count",
    "llmkit:prompt_tokens_total", "llmkit:generation_tokens_total",
    "llmkit:num_requests_running", "llmkit:num_requests_waiting",
    "llmkit:kv_cache_usage_perc", "llmkit:prefix_cache_queries_total",
    "llmkit:prefix_cache_hits_total", "llmkit:num_preemptions_total", "llmkit:engine_up",
]


def test_metrics_exported(env, client):
    before = env.server.metrics()
    resp = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    after = env.server.metrics()
    for name in EXPECTED_METRICS:
        assert name in after, name
    assert after["llmkit:generation_tokens_total"] - before["llmkit:generation_tokens_total"] \
        == resp.usage.completion_tokens == 5
    assert after["llmkit:prompt_tokens_total"] - before["llmkit:prompt_tokens_total"] \
        == resp.usage.prompt_tokens
    assert after["llmkit:time_to_first_token_seconds_count"] \
        == before["llmkit:time_to_first_token_seconds_count"] + 1
    key = f'llmkit:request_success_total{{finished_reason="length",model_name="{env.model}"}}'
    assert after[key] == before[key] + 1
    assert after["llmkit:engine_up"] == 1.0


def test_client_disconnect_aborts_and_frees_blocks(env):
    """Close the connection after the first chunk of a long stream: the request is aborted
    (not finished: the abort counter moves, far fewer than max_tokens were generated) and its
    blocks are back (KV usage 0, nothing running)."""
    model = env.model
    abort_key = f'llmkit:request_success_total{{finished_reason="abort",model_name="{model}"}}'
    body = {"model": model, "prompt": PROMPT, "max_tokens": 450, "stream": True,
            "temperature": 0, "ignore_eos": True}
    m0 = env.server.metrics()
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", env.server.url("/v1/completions"), json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break
        # leaving the block closes the connection mid-stream

    def aborted_and_freed():
        m = env.server.metrics()
        return (m[abort_key] == m0[abort_key] + 1 and m["llmkit:num_requests_running"] == 0
                and m["llmkit:kv_cache_usage_perc"] == 0)
    assert wait_for(aborted_and_freed, 5), env.server.metrics()
    m1 = env.server.metrics()
    assert m1["llmkit:generation_tokens_total"] - m0["llmkit:generation_tokens_total"] < 450

    # The same for a request that is not streamed: the client gives up waiting. The engine
    # core is frozen meanwhile, so the request is still in flight when the client leaves
    # (a fast CPU would otherwise finish its 450 tokens within the read timeout) and the
    # server aborts it before the engine can run it to its end.
    m0 = m1
    with paused(env.server.engine_pid):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(env.server.url("/v1/completions"), json={**body, "stream": False},
                       timeout=httpx.Timeout(5, read=0.05))
        assert wait_for(lambda: env.server.metrics()[abort_key] == m0[abort_key] + 1, 5), \
            env.server.metrics()
    # Resumed: a fresh snapshot of the engine is answered after the abort (sent before it)
    # was handled and its stats published, so the gauges below are the engine's after it,
    # at once (no waiting in which the request could have run to its end instead).
    assert httpx.get(env.server.url("/v1/engine/stats"), params={"fresh": "true"},
                     timeout=30).status_code == 200

    def aborted_and_freed_again():
        m = env.server.metrics()
        return (m[abort_key] == m0[abort_key] + 1 and m["llmkit:num_requests_running"] == 0
                and m["llmkit:kv_cache_usage_perc"] == 0)
    assert aborted_and_freed_again(), env.server.metrics()


def test_32_concurrent_streams_match_offline(env):
    words = ("The river flows through the city and the bridges are old and beautiful. "
             "People ask questions about the weather, about history and travel.").split()
    prompts = [" ".join(words[i % 7:i % 7 + 3 + i % 11]) for i in range(32)]
    expected = [o.outputs[0].text for o in
                env.offline.generate(prompts, greedy(64), use_tqdm=False)]
    client = env.server.async_client()
    engine_pid = env.server.engine_pid
    # Whether the streams overlap is not left to the CPU's speed (a fast one decodes a token
    # in ~0.3 ms): the engine core is frozen while all 32 are admitted (a stream's response
    # headers come once its request is sent), then resumed with all of them waiting in its
    # input. It resumes more than a publication period after its last published step, so
    # the first step it runs is published; the published steps show how many ran at once.
    latest = httpx.get(env.server.url("/v1/engine/stats"), timeout=30).json()["latest"]
    before = latest["step"] if latest else 0

    async def start(prompt: str):
        return await client.completions.create(model=env.model, prompt=prompt, max_tokens=64,
                                               temperature=0, stream=True)

    async def read(stream) -> str:
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        try:
            with paused(engine_pid):
                streams = await asyncio.wait_for(
                    asyncio.gather(*(start(p) for p in prompts)), 30)
                await asyncio.sleep(0.3)  # > 1 / server.engine_events_per_s (10)
            return await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), 60)
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert texts == expected
    recent = httpx.get(env.server.url("/v1/engine/stats"), params={"history": 256},
                       timeout=30).json()["recent"]
    mine = [e for e in recent if e["step"] > before and e["step_ms"] > 0]
    assert mine, recent[-5:]
    assert max(e["num_running"] for e in mine) > 1, [e["num_running"] for e in mine]


def test_cache_salt_isolates_prefix_cache(env, client):
    prompt = [(7 * i + 3) % 300 + 20 for i in range(40)]  # 40 ids: 2 full blocks of 16 shareable

    def hits_after(salt: str) -> float:
        client.completions.create(model=env.model, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"cache_salt": salt})
        return env.server.metrics()["llmkit:prefix_cache_hits_total"]

    start = env.server.metrics()["llmkit:prefix_cache_hits_total"]
    first = hits_after("tenant-a")
    other = hits_after("tenant-b")
    same = hits_after("tenant-a")
    assert first == start and other == first  # a new salt finds nothing cached
    assert same - other == 32  # the same salt hits both full blocks


# --------------------------------------------------------------------------- shutdown (last)

def test_sigterm_finishes_in_flight_then_exits(env):
    """Graceful shutdown: stop accepting, let the request in flight finish, stop the engine
    process, exit 0."""
    server = env.server
    engine_pid = server.engine_pid
    client = server.client()
    stream = client.completions.create(model=env.model, prompt=PROMPT, max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) \
        == offline_text(env, PROMPT, greedy(200, ignore_eos=True))[0]
    assert server.proc.wait(30) == 0
    assert wait_for(lambda: not pid_alive(engine_pid), 5), "engine process left behind"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url("/health"), timeout=2)
    assert "Traceback" not in server.log()

