"""``POST /v1/responses`` (OpenAI's Responses API) through the official ``openai`` client:
``client.responses.create`` (streamed and not) and ``client.responses.stream``, checked against
``/v1/chat/completions`` on the same conversation (both go through the same engine path);
typed events in order with consecutive ``sequence_number``s; ``previous_response_id`` puts
the earlier turn into the prompt (its token count is the rendered conversation's);
``tools`` make ``function_call`` items; ``text.format`` makes schema-valid JSON; bad fields
are 400s in OpenAI's body."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from helpers.server_process import SERVER_THREADS, ServerProcess, error_body

STORE_SIZE = 4
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "enum": [7, 42]}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Berlin"]},
               "days": {"type": "integer", "enum": [1, 2, 3]}},
               "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir("llama", max_position_embeddings=2048),
                       "kv_cache.num_blocks=512", SERVER_THREADS,
                       f"server.responses_store_size={STORE_SIZE}",
                       "structured_output.disable_any_whitespace=true",
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


def chat_text(client, model, messages, max_tokens):
    r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage.prompt_tokens


def prompt_tokens(server, messages) -> int:
    return httpx.post(server.url("/tokenize"), json={"messages": messages}).json()["count"]


def test_text_input_matches_chat(server, client, model):
    r = client.responses.create(model=model, input="What is the capital of France?",
                                max_output_tokens=12, temperature=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text, n_prompt = chat_text(client, model, messages, 12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == n_prompt == prompt_tokens(server, messages)
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == n_prompt + 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_chat_style_input(server, client, model):
    items = [{"role": "user", "content": "Hello"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Tell me a story"}]}]
    r = client.responses.create(model=model, input=items, instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"},
                {"role": "user", "content": "Tell me a story"}]
    text, n_prompt = chat_text(client, model, messages, 8)
    assert r.output_text == text and r.usage.input_tokens == n_prompt
    assert r.instructions == "Be brief."


def test_previous_response_id_continues_the_conversation(server, client, model):
    first = client.responses.create(model=model, input="Hello", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=model, input="And then?", max_output_tokens=6,
                                     temperature=0, previous_response_id=first.id)
    # the engine saw the earlier turn and its answer (not the earlier instructions)
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    text, n_prompt = chat_text(client, model, messages, 6)
    assert second.usage.input_tokens == n_prompt == prompt_tokens(server, messages)
    assert second.output_text == text
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == text


def test_streamed_events_in_order_with_sequence_numbers(client, model):
    kw = dict(model=model, input="Tell me a story", max_output_tokens=10, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert deltas and types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert "".join(events[i].delta for i in deltas) == plain.output_text
    assert events[-3].part.text == events[-4].text == plain.output_text
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events[2:-1])
    final = events[-1].response
    assert final.output[0].id == item_id and final.output_text == plain.output_text
    assert final.usage.output_tokens == 10 and events[0].response.status == "in_progress"


def test_responses_stream_helper(client, model):
    # A random model does not stop by itself: the stream ends with response.incomplete
    # (get_final_response needs response.completed: see the tools and text.format tests).
    kw = dict(model=model, input="What is the capital of France?", temperature=0,
              max_output_tokens=16)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"
    assert "".join(texts) == events[-1].response.output_text == plain.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_tools_make_function_call_items(server, client, model, stream):
    kw = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice="required", temperature=0, max_output_tokens=300)
    if stream:
        with client.responses.stream(**kw) as s:
            events = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in events
        assert "response.function_call_arguments.done" in events
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # the call and its result continue the conversation
    follow = client.responses.create(
        model=model, previous_response_id=r.id, temperature=0, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": c.call_id, "type": "function", "function": {
                        "name": c.name, "arguments": c.arguments}} for c in calls]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]
    assert follow.usage.input_tokens == prompt_tokens(server, messages)


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(client, model, stream):
    kw = dict(model=model, input="Describe a person", temperature=0, max_output_tokens=200,
              text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                               "strict": True}})
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_store_keeps_the_latest(client, model):
    ids = [client.responses.create(model=model, input=f"n{i}", max_output_tokens=1).id
           for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id"
    client.responses.retrieve(ids[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    unstored = client.responses.create(model=model, input="x", max_output_tokens=1,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nope"}}}}, "text"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_fields_are_openai_errors(server, body, param):
    resp = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    assert error_body(resp)["param"] == param, resp.text
    assert "Traceback" not in server.log()
