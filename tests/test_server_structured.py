"""Structured output and tool calling through the server (issue 19), with the official
``openai`` client: ``response_format`` (json_schema, json_object), vLLM's ``structured_outputs``
and the older ``guided_*`` fields, bad specs as 400s, and ``tools`` with ``tool_choice``
required / named (arguments always validate) / none / auto, streamed as OpenAI deltas.

The tiny random model cannot choose to call a tool by itself; ``required`` and a named function
force the calls by grammar, so they are tested end to end here, and the Hermes parser of
``auto`` on texts in ``test_tool_calls.py``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import jsonschema
import pytest

from helpers.structured_backends import FAILS_IN_ENGINE
from helpers.tool_specs import SCHEMA_OF, SEARCH, TOOLS, WEATHER
from helpers.server_process import SERVER_THREADS, ServerProcess, error_body

TESTS = Path(__file__).resolve().parent

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]},
             "maxItems": 2}},
    "required": ["name", "age"]}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # A longer context than the default tiny model's: the tool prompt lists the functions.
    model_dir = tiny_model_dir("llama", max_position_embeddings=2048)
    # xgrammar, but one marked regex fails to compile inside the engine core
    backend = "structured_output._target_=helpers.structured_backends.FailInEngineBackend"
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    with ServerProcess(model_dir, "kv_cache.num_blocks=512", SERVER_THREADS,
                       "structured_output.disable_any_whitespace=true", backend,
                       log_path=tmp_path_factory.mktemp("server") / "server.log",
                       env={"PYTHONPATH": pythonpath}) as srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def check_calls(calls, names=None) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA_OF[c.function.name])


# --------------------------------------------------------------------------- response_format

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, model, temperature):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=120, temperature=temperature, seed=3,
        n=2, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_streamed(client, model):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=1, stream=True,
        response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


def test_completions_structured_outputs_and_guided_names(client, model):
    regex = r"[A-Z][a-z]{2,5} \d{2}"
    out = client.completions.create(model=model, prompt="Name and age:", max_tokens=16,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].text)
    choices = ["alpha", "beta", "gamma"]
    out = client.completions.create(model=model, prompt="Pick one:", max_tokens=8,
                                    temperature=1.0, n=3, extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in out.choices)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100,
                                         extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = client.completions.create(model=model, prompt="Sum:", max_tokens=16,
                                    extra_body={"guided_grammar": 'root ::= [0-9] "+" [0-9]'})
    assert re.fullmatch(r"[0-9]\+[0-9]", out.choices[0].text)


@pytest.mark.parametrize("body,param,match", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "Unsupported type"),
    ({"guided_regex": "[a-z"}, "guided_regex", "Unclosed"),
    ({"structured_outputs": {"grammar": "rot ::= \"a\""}}, "structured_outputs", "root"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}],
      "tool_choice": "required"}, "tools", "multipleOf"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "cannot be combined"),
])
def test_bad_specs_are_400_naming_the_field(server, model, body, param, match):
    resp = post(server, "/v1/chat/completions",
                {"model": model, "messages": MESSAGES, "max_tokens": 8, **body})
    assert resp.status_code == 400, resp.text
    err = error_body(resp)
    assert err["param"] == param and re.search(match, err["message"]), err
    # the engine goes on
    ok = post(server, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_compile_failure_in_the_engine_is_that_requests_400(server, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 4,
            "structured_outputs": {"regex": f"a+{FAILS_IN_ENGINE}"}}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    assert "a test's failure" in error_body(resp)["message"]
    stream = httpx.post(server.url("/v1/completions"), json={**body, "stream": True},
                        timeout=60).text
    assert "a test's failure" in stream and stream.rstrip().endswith("data: [DONE]")
    ok = post(server, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and server.proc.poll() is None


# --------------------------------------------------------------------------- tools

@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(client, model, parallel):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=5, n=3, parallel_tool_calls=parallel)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, {"get_weather", "search"})
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_tool_choice_named(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "search"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"search"})
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls(client, model, tool_choice):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
        temperature=1.0, seed=2, stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call names it
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                else:
                    assert not d.id and not d.function.name
                calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == "" and calls
    assert sorted(calls) == list(range(len(calls)))
    for c in calls.values():
        jsonschema.validate(json.loads(c["args"]), SCHEMA_OF[c["name"]])
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls.values()] == ["get_weather"]


def test_tool_history_and_tool_choice_none(client, model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "And in Rome?"}]
    for choice in ("none", "auto"):
        resp = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                              tool_choice=choice, max_tokens=12, temperature=0)
        c = resp.choices[0]
        assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
        assert c.message.content
    # a named call in the same conversation is still forced to validate
    resp = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=100, temperature=1.0, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_calls(resp.choices[0].message.tool_calls, {"get_weather"})


def _streamed(client, **kw) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed chat's calls (name, argument text joined from the deltas) and finish."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])
                calls[d.index][1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_same_streamed_or_not(client, model, parallel):
    """Issue 31: one greedy request, streamed and not: the same calls and the same finish
    reason, "tool_calls" once the model ends after a call (the grammar lets it end after any
    complete call with parallel_tool_calls, after the only one without)."""
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              max_tokens=300, temperature=0.0, parallel_tool_calls=parallel)
    resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls, {"get_weather", "search"})
    calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    if not parallel:
        assert len(calls) == 1


def test_required_call_cut_by_max_tokens_is_in_both(client, model):
    """Issue 31: a call cut by max_tokens reaches the client streamed and not, with the
    argument text written so far and finish_reason "length"."""
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              temperature=0.0, parallel_tool_calls=False)
    full = client.chat.completions.create(max_tokens=300, logprobs=True, **kw).choices[0]
    assert full.finish_reason == "tool_calls"
    # the token count that ends a few tokens inside the arguments object
    pieces = [t.token for t in full.logprobs.content]
    text = ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        if '"arguments": {' in text and len(text) > text.index('"arguments": {') + 16:
            break
    cut = client.chat.completions.create(max_tokens=n, **kw).choices[0]
    assert cut.finish_reason == "length"
    assert len(cut.message.tool_calls) == 1
    args = cut.message.tool_calls[0].function.arguments
    assert args and full.message.tool_calls[0].function.arguments.startswith(args)
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)  # cut: not a complete object
    calls, finish = _streamed(client, max_tokens=n, **kw)
    assert finish == "length"
    assert calls == [(cut.message.tool_calls[0].function.name, args)]
