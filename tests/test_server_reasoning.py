"""Reasoning output through the server (``server.reasoning_parser=qwen3``) with the official
``openai`` client: the thinking comes back as ``reasoning_content`` (and ``reasoning``) apart
from ``content``, streamed or not; ``chat_template_kwargs.enable_thinking=false`` reaches the
template; structured output and forced tool calls apply to the answer after ``</think>``.

A random model never writes ``<think>``: this one is scripted (``scripted_models.py``): after
the generation prompt it writes ``<think> capital is</think> France the`` and stops.
"""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from helpers.scripted_models import build_scripted_model_dir, single_tokens, thinking_tokenizer
from helpers.server_process import REPO, SERVER_THREADS, ServerProcess

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
THINKING, ANSWER = " capital is", " France the"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}


def script(tok) -> dict[int, int]:
    nl, cap, is_, france, the = single_tokens(tok, ["\n", " capital", " is", " France", " the"])
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    return {nl: think, think: cap, cap: is_, is_: end, end: france, france: the,
            the: tok.eos_token_id}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = thinking_tokenizer()
    return build_scripted_model_dir(tmp_path_factory.mktemp("thinker"), tok, script(tok),
                                    max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(model_dir, "kv_cache.num_blocks=512", SERVER_THREADS,
                       "server.reasoning_parser=qwen3",
                       "structured_output.disable_any_whitespace=true",
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                          **kw)


def test_thinking_is_reasoning_content(client, model):
    r = chat(client, model)
    msg = r.choices[0].message
    assert msg.reasoning_content == THINKING and msg.reasoning == THINKING
    assert msg.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 7  # <think>, 2 thinking, </think>, 2 answer, eos


def test_streamed_deltas_split_the_same(client, model):
    reasoning, alias, content = [], [], []
    for chunk in chat(client, model, stream=True):
        for c in chunk.choices:
            d = c.delta
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            alias.append(getattr(d, "reasoning", None) or "")
            content.append(d.content or "")
            # a delta never carries a marker as text
            assert "think>" not in reasoning[-1] + content[-1]
    assert "".join(reasoning) == "".join(alias) == THINKING
    assert "".join(content) == ANSWER
    assert sum(1 for r in reasoning if r) >= 2  # streamed, not sent at the end


def test_cut_off_while_thinking_is_all_reasoning(client, model):
    r = chat(client, model, max_tokens=2)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (" capital", None)
    assert r.choices[0].finish_reason == "length"


def test_enable_thinking_false_reaches_the_template(client, model):
    # The template closes an empty block in the prompt: the model goes on after </think>.
    r = chat(client, model, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.reasoning_content is None and msg.content == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_applies_to_the_answer(client, model, stream):
    # Applied from the first token, the grammar would forbid <think> and there would be no
    # reasoning; after </think> it forces the JSON in place of " France".
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    if stream:
        reasoning, content = "", ""
        for chunk in chat(client, model, response_format=fmt, stream=True):
            for c in chunk.choices:
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
    else:
        msg = chat(client, model, response_format=fmt).choices[0].message
        reasoning, content = msg.reasoning_content, msg.content
    assert reasoning == THINKING
    jsonschema.validate(json.loads(content), CITY)


def test_structured_output_after_a_closed_prompt_block_applies_at_once(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    msg = chat(client, model, response_format=fmt,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}}
               ).choices[0].message
    assert msg.reasoning_content is None
    jsonschema.validate(json.loads(msg.content), CITY)


def test_forced_tool_call_follows_the_thinking(client, model):
    tool = {"type": "function", "function": {"name": "capital", "parameters": CITY}}
    r = chat(client, model, tools=[tool],
             tool_choice={"type": "function", "function": {"name": "capital"}})
    msg = r.choices[0].message
    assert msg.reasoning_content == THINKING
    assert [c.function.name for c in msg.tool_calls] == ["capital"]
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), CITY)


def test_unknown_reasoning_parser_is_a_start_up_error_naming_the_key(model_dir):
    proc = subprocess.run([sys.executable, "-m", "llmkit.entrypoints.cli", "serve",
                           str(model_dir), "server.port=0", "server.reasoning_parser=nope"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "server.reasoning_parser" in proc.stderr and "'nope'" in proc.stderr, proc.stderr
    assert "qwen3" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_has_a_reasoning_item(client, model, stream):
    kw = dict(model=model, input=MESSAGES[0]["content"], temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            events = list(s)
            r = s.get_final_response()
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thinking == THINKING
        assert [e.sequence_number for e in events] == list(range(len(events)))
    else:
        r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINKING
    assert r.output_text == ANSWER and r.status == "completed"
    # <think>, " capital", " is", </think> of 7 output tokens
    assert (r.usage.output_tokens_details.reasoning_tokens, r.usage.output_tokens) == (4, 7)
