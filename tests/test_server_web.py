"""The web pages (``/``, ``/engine``) and their data (``/v1/engine/stats``, ``/v1/engine/events``),
CORS and the body limit, on one server with an API key; and the pages in a real headless
browser: Debian's ``chromium`` driven by ``playwright`` (skipped, with the reason, when either
is missing). Screenshots go to ``test-artifacts/web/`` (``LLMKIT_TEST_ARTIFACTS`` overrides).
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.processes import wait_for
from helpers.server_process import SERVER_THREADS, ServerProcess, error_body
from helpers.web_browser import ARTIFACTS, open_page, record_first, recorded

REPO = Path(__file__).resolve().parents[1]
KEY = "web-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"
EVENTS_PER_S = 20


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # A longer context than the default tiny model's, so that a reply can stream for seconds.
    model_dir = tiny_model_dir("llama", max_position_embeddings=4096)
    with ServerProcess(model_dir, f"server.api_key={KEY}", f"server.allowed_origins=[{ORIGIN}]",
                       "server.max_request_bytes=65536",
                       f"server.engine_events_per_s={EVENTS_PER_S}",
                       "kv_cache.num_blocks=1024", "server.shutdown_timeout=2", SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url("/v1/models"), headers=AUTH).json()["data"][0]["id"]


def stats(server, **params) -> dict:
    resp = httpx.get(server.url("/v1/engine/stats"), params=params, headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_idle(server) -> dict:
    """The engine's state once nothing runs or waits (fresh, with the KV integrity check)."""
    result = {}

    def idle():
        result.update(stats(server, check_kv="true")["latest"])
        return result["num_running"] == 0 and result["num_waiting"] == 0
    assert wait_for(idle, 15), result
    return result


# --------------------------------------------------------------------------- pages

def test_pages_are_public_and_self_contained(server):
    for path, title in (("/", "llmkit · chat"), ("/engine", "llmkit · engine")):
        resp = httpx.get(server.url(path))  # no key: the pages are public
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
        assert f"<title>{title}</title>" in resp.text
        assert "default-src 'self'" in resp.headers["content-security-policy"]
        refs = re.findall(r'(?:src|href)="([^"]+)"', resp.text)
        assert refs and all(r.startswith(("/", "data:")) for r in refs), refs  # no CDN
        for ref in refs:
            if ref.startswith("/ui/"):
                asset = httpx.get(server.url(ref))
                assert asset.status_code == 200, ref
                kind = "text/javascript" if ref.endswith(".js") else "text/css"
                assert asset.headers["content-type"].startswith(kind), ref
                assert not re.search(r"https?://", asset.text), ref  # nothing fetched from afar
    missing = httpx.get(server.url("/ui/../server.py"))
    assert missing.status_code == 404 and error_body(missing)["code"] == "not_found"
    assert httpx.get(server.url("/ui/nope.js")).status_code == 404
    # the pages are not API operations
    assert "/engine" not in httpx.get(server.url("/openapi.json")).json()["paths"]


def test_pages_ship_as_package_data():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["llmkit.entrypoints.openai"]
    pages = REPO / "llmkit" / "entrypoints" / "openai" / "pages"
    files = sorted(p.name for p in pages.iterdir() if p.is_file())
    assert files and all(any(Path("pages", f).match(p) for p in patterns) for f in files)


def test_engine_endpoints_need_the_key(server):
    for path in ("/v1/engine/stats", "/v1/engine/events"):
        resp = httpx.get(server.url(path))
        assert resp.status_code == 401 and error_body(resp)["code"] == "invalid_api_key"
    schema = httpx.get(server.url("/openapi.json")).json()
    assert schema["paths"]["/v1/engine/stats"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


# --------------------------------------------------------------------------- engine data

def read_events(server, into: list, stop: threading.Event, ready: threading.Event) -> None:
    with httpx.stream("GET", server.url("/v1/engine/events"), headers=AUTH,
                      timeout=httpx.Timeout(30, read=60)) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        ready.set()
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                into.append((name, json.loads(line[6:])))
            if stop.is_set():
                return


def test_events_follow_a_request_and_blocks_come_back(server, model):
    """One stream of 2000 tokens: the events show it running with the blocks it needs, their
    steps add up (published + skipped = every step; tokens likewise), the publication rate
    stays under server.engine_events_per_s, and once it ends every block is back."""
    before = stats(server, fresh="true")["latest"]
    events: list = []
    stop, ready = threading.Event(), threading.Event()
    reader = threading.Thread(target=read_events, args=(server, events, stop, ready),
                              daemon=True)
    reader.start()
    assert ready.wait(10)
    start = time.monotonic()
    # 2000 tokens (of the 4096 context): even at ~0.3 ms a token (a fast CPU) the stream runs
    # for many publication periods, so a step well into it (past token 100) is published.
    max_tokens = 2000
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=AUTH,
                      timeout=60) as resp:
        rid = None
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                rid = rid or json.loads(line[6:])["id"]
    elapsed = time.monotonic() - start
    assert wait_for(lambda: any(e[1]["num_running"] == 0 and e[1]["step"] > before["step"]
                                for e in events), 10)
    stop.set()
    steps = [e for name, e in events if name == "step"]
    assert steps and all(name == "step" for name, _ in events)
    mine = [r for e in steps for r in e["requests"] if r["request_id"] == rid]
    assert mine, f"{rid} never seen in {len(steps)} events"
    prompt_len = mine[0]["num_prompt_tokens"]
    for r in mine:
        assert r["status"] == "running"
        # a request holds the blocks for the tokens it has computed
        assert r["num_blocks"] >= -(-r["num_computed_tokens"] // 16)
    assert max(r["num_computed_tokens"] for r in mine) > prompt_len + 100
    # Published steps and counted ones add up to every step, and their tokens too.
    series = [before] + [e for e in steps if e["step"] > before["step"]]
    for prev, cur in zip(series, series[1:]):
        ran = 1 if cur["step_ms"] > 0 else 0  # a snapshot between steps ran none
        assert cur["step"] - prev["step"] == cur["steps_skipped"] + ran, (prev, cur)
        assert cur["total_scheduled_tokens"] - prev["total_scheduled_tokens"] == \
            cur["tokens_skipped"] + cur["num_scheduled_tokens"]
        assert cur["num_prefill_tokens"] + cur["num_decode_tokens"] == \
            cur["num_scheduled_tokens"]
    total = series[-1]["total_scheduled_tokens"] - before["total_scheduled_tokens"]
    # the prompt, then one token per new one but the last
    assert total == prompt_len + max_tokens - 1
    # Rate-limited: a step event at most every 1/EVENTS_PER_S s (+ one idle snapshot).
    published = [e for e in series[1:] if e["step_ms"] > 0]
    assert len(published) <= EVENTS_PER_S * elapsed + 2
    final = wait_idle(server)
    assert final["num_held_blocks"] == 0 and final["requests"] == []
    assert final["kv_checked"] and final["kv_integrity_error"] is None
    assert final["num_cached_blocks"] > 0  # the finished request's blocks stay cached
    # The feed keeps the snapshots it published, and a fast CPU runs the stream above within
    # a few publication periods: five more requests, each after a pause longer than a period,
    # publish at least one step each.
    short = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for _ in range(5):
        time.sleep(2 / EVENTS_PER_S)
        assert httpx.post(server.url("/v1/completions"), json=short, headers=AUTH,
                          timeout=60).status_code == 200
    wait_idle(server)
    recent = stats(server, history=5)
    assert len(recent["recent"]) == 5 and recent["engine"]["num_blocks"] == 1024
    ring = [e["step"] for e in recent["recent"]]
    assert ring == sorted(ring) and ring[-1] > series[-1]["step"], ring  # the newest five
    assert recent["engine"]["up"] and recent["engine"]["events_per_s"] == EVENTS_PER_S


# --------------------------------------------------------------------------- CORS, limits

def test_cors_only_for_allowed_origins(server):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(server.url("/v1/chat/completions"), headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(server.url("/v1/chat/completions"),
                          headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in other.headers
    # Answers to an allowed origin are readable by its pages, errors included.
    denied = httpx.get(server.url("/v1/models"), headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    models = httpx.get(server.url("/v1/models"), headers={"Origin": "http://evil.example",
                                                          **AUTH})
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_cors_is_off_by_default():
    from llmkit.config.compose import build_config

    assert build_config("smollm2-135m-instruct").server.allowed_origins == []


def test_request_body_limit_is_413(server, model):
    big = json.dumps({"model": model, "prompt": "hello " * 20000}).encode()
    assert len(big) > 65536
    resp = httpx.post(server.url("/v1/completions"), content=big, headers={
        **AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 413 and error_body(resp)["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    resp = httpx.post(server.url("/v1/completions"), content=chunks(), headers={
        **AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 413 and "server.max_request_bytes" in error_body(resp)["message"]
    small = httpx.post(server.url("/v1/completions"), headers=AUTH,
                       json={"model": model, "prompt": "hello", "max_tokens": 2})
    assert small.status_code == 200


# --------------------------------------------------------------------------- the browser

def chat_reply(server, model, messages, max_tokens) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(server.url("/v1/chat/completions"), json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_chat_streams_a_reply_while_the_engine_view_shows_it(browser, server, model):
    """The chat page streams a long greedy reply; meanwhile the engine page lists the request
    as running with its KV blocks; the reply equals the API's, with TTFT and tok/s shown."""
    max_tokens = 3500  # of the 4,096-token context: seconds of streaming even when decode is fast
    question = None
    for q in ("What is the capital of France?", "Tell me a story about a robot.",
              "Please write a short poem about the moon."):
        expected = chat_reply(server, model, [{"role": "user", "content": q}], max_tokens)
        if expected["finish_reason"] == "length":  # long enough to watch it stream
            question = q
            break
    assert question is not None, "every candidate reply stopped early"

    engine, engine_problems = open_page(browser, server, "/engine")
    engine.fill("#api-key", KEY)
    engine.dispatch_event("#api-key", "change")  # the key is kept in localStorage
    engine.reload()  # from the start with the key: no 401 in the console
    engine_problems.clear()
    engine.wait_for_selector("#status:text-is('live')")

    chat, chat_problems = open_page(browser, server, "/")
    chat.wait_for_selector("#model option", state="attached")
    assert chat.input_value("#model") == model
    chat.focus("#temperature")
    chat.keyboard.press("Home")  # temperature 0: greedy
    assert chat.input_value("#temperature") == "0"
    chat.fill("#max-tokens", str(max_tokens))
    chat.fill("#prompt", question)
    # Both pages record what they show as it happens (MutationObservers run right after each
    # event is drawn): polling from here can miss a reply that a fast CPU streams within a second.
    record_first(engine, "requests", """
        const tr = document.querySelector("#requests tr[data-status='running']");
        return tr ? [tr.innerText, document.getElementById("held").textContent,
                     document.getElementById("running").textContent] : null;""")
    chat.evaluate("""() => {
        window.seen = {busy: [], lengths: []};
        new MutationObserver(() => seen.busy.push(document.body.dataset.busy))
            .observe(document.body, {attributes: true, attributeFilter: ["data-busy"]});
        new MutationObserver(() => {
            const body = [...document.querySelectorAll(".msg.assistant .body")].pop();
            if (document.body.dataset.busy === "1" && body) seen.lengths.push(body.textContent.length);
        }).observe(document.getElementById("messages"),
                   {childList: true, subtree: true, characterData: true});
    }""")
    chat.press("#prompt", "Enter")

    # While it streams: the engine view lists the request as running; the reply grows.
    row, held, num_running = recorded(engine)
    engine.screenshot(path=str(ARTIFACTS / "engine-while-streaming.png"))
    chat.screenshot(path=str(ARTIFACTS / "chat-while-streaming.png"))
    assert "chatcmpl-" in row and int(held) > 0 and num_running == "1", (row, held, num_running)
    chat.wait_for_function("() => seen.busy.includes('1') && document.body.dataset.busy === ''",
                           polling=100, timeout=120_000)
    assert chat.evaluate("seen.busy") == ["1", ""]
    partial = [n for n in chat.evaluate("seen.lengths") if n]
    assert len(set(partial)) >= 2 and partial == sorted(partial), partial  # it streams
    reply = chat.locator(".msg.assistant .body").last
    assert reply.inner_text() == expected["message"]["content"]
    line = chat.locator(".msg.assistant .stats").last.inner_text()
    m = re.fullmatch(r"TTFT (\d+) ms · ([\d.]+) tok/s · (\d+) tokens · finish: length", line)
    assert m, line
    assert int(m.group(3)) == max_tokens and float(m.group(2)) > 0
    chat.screenshot(path=str(ARTIFACTS / "chat-after-reply.png"))

    # Afterwards the engine view empties and every block is back.
    engine.wait_for_selector("#requests td:text-is('no requests in the engine')")
    assert wait_for(lambda: engine.inner_text("#held") == "0", 10)
    assert int(engine.inner_text("#steps")) > max_tokens
    engine.screenshot(path=str(ARTIFACTS / "engine-after.png"))
    assert not chat_problems and not engine_problems, chat_problems + engine_problems
    chat.close()
    engine.close()


def test_chat_keeps_the_conversation(browser, server, model):
    """A second message is answered with the whole conversation (and the system prompt); the
    conversation survives a reload of the page; New chat clears it."""
    chat, problems = open_page(browser, server, "/")  # the key is still in localStorage
    chat.wait_for_selector("#model option", state="attached")
    chat.click("#new-chat")
    chat.focus("#temperature")
    chat.keyboard.press("Home")
    chat.fill("#max-tokens", "12")
    chat.fill("#system", "You are terse.")
    chat.dispatch_event("#system", "change")
    turns = []
    for question in ("Hello, how are you today?", "What is the capital of France?"):
        chat.fill("#prompt", question)
        chat.click("#send")
        chat.wait_for_selector(f".msg.assistant >> nth={len(turns)}")
        chat.wait_for_selector("body[data-busy='']", state="attached")
        turns.append(question)
    history = [{"role": "system", "content": "You are terse."}]
    replies = chat.locator(".msg.assistant .body").all_inner_texts()
    assert len(replies) == 2
    for question, reply in zip(turns, replies):
        history.append({"role": "user", "content": question})
        assert reply == chat_reply(server, model, history, 12)["message"]["content"]
        history.append({"role": "assistant", "content": reply})
    chat.reload()
    chat.wait_for_selector(".msg.assistant >> nth=1")
    assert chat.locator(".msg.assistant .body").all_inner_texts() == replies
    chat.screenshot(path=str(ARTIFACTS / "chat-conversation.png"))
    chat.click("#new-chat")
    assert chat.locator(".msg").count() == 0
    assert not problems, problems
    chat.close()


def test_pages_show_a_missing_key(browser, server):
    context_page, _ = open_page(browser, server, "/engine")
    context_page.fill("#api-key", "wrong")
    context_page.dispatch_event("#api-key", "change")
    context_page.wait_for_selector("#status:has-text('API key needed')")
    context_page.fill("#api-key", KEY)
    context_page.dispatch_event("#api-key", "change")
    context_page.wait_for_selector("#status:text-is('live')")
    context_page.close()
