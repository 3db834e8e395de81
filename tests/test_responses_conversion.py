"""The Responses API's request → chat request conversion and its stream's event writer, without
a server: input items become the chat turns the template sees, ``text.format`` and flat tools
become the chat fields, and the writer's events open and close items in OpenAI's order with
consecutive sequence numbers whatever kinds of output follow each other."""
from __future__ import annotations

import json

import pytest

from llmkit.entrypoints.openai.errors import OpenAIError
from llmkit.entrypoints.openai.responses import _EventWriter, chat_request, input_messages
from llmkit.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from llmkit.entrypoints.openai.responses_store import ResponsesStore, StoredResponse


def req(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate(kw)


def test_items_become_chat_turns():
    r = req(input=[
        {"role": "developer", "content": "Be nice."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look "},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}])
    assert input_messages(r) == [
        {"role": "developer", "content": "Be nice."},
        {"role": "user", "content": [
            {"type": "text", "text": "look "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]
    assert input_messages(req(input="hi")) == [{"role": "user", "content": "hi"}]


def test_fields_become_the_chat_request():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    r = req(input="hi", max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3,
            tools=[{"type": "function", "name": "f", "parameters": schema}],
            tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "n", "schema": schema,
                             "strict": True}})
    chat = chat_request(r, [{"role": "user", "content": "hi"}])
    assert chat.max_output_tokens == 7 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.seed == 3 and chat.parallel_tool_calls is False
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.parameters == schema
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.json_schema == schema
    obj = chat_request(req(input="hi", text={"format": {"type": "json_object"}}),
                       [{"role": "user", "content": "x"}])
    assert obj.response_format.type == "json_object"
    assert chat_request(req(input="hi", text={"format": {"type": "text"}}),
                        [{"role": "user", "content": "x"}]).response_format is None


def test_what_the_chat_path_refuses_names_the_responses_field():
    with pytest.raises(OpenAIError) as e:
        chat_request(req(input="hi", text={"format": {"type": "json_schema", "name": "n"}}),
                     [{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == "text"
    with pytest.raises(OpenAIError) as e:  # an empty message list
        chat_request(req(input="hi"), [])
    assert e.value.param == "input"


def _events(chunks: list[str]) -> list[dict]:
    out = []
    for c in chunks:
        kind, data = c.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_event_writer_opens_and_closes_items_in_order():
    w = _EventWriter()
    chunks = [w.emit("response.created", response={}), *w.reasoning("hm"),
              *w.reasoning("m"), *w.text("Hi"),
              *w.tool_call({"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": ""}}),
              *w.tool_call({"index": 0, "function": {"arguments": "{\"a\""}}),
              *w.tool_call({"index": 0, "function": {"arguments": ": 1}"}}), *w.close()]
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [d["output_index"] for d in done] == [0, 1, 2]
    assert done[0]["item"]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert done[1]["item"]["content"][0]["text"] == "Hi"
    assert done[2]["item"]["arguments"] == "{\"a\": 1}" and done[2]["item"]["call_id"] == "call_1"
    assert [i.type for i in w.output] == ["reasoning", "message", "function_call"]
    assert all(d["item"]["status"] == "completed" for d in done)


def test_store_drops_the_oldest_and_keeps_what_is_read():
    store = ResponsesStore(2)
    for i in range(3):
        store.put(StoredResponse(ResponseObject(id=f"r{i}", model="m"), []))
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")  # read: now the newest
    store.put(StoredResponse(ResponseObject(id="r3", model="m"), []))
    assert store.get("r1") is not None and store.get("r2") is None
    none = ResponsesStore(0)
    none.put(StoredResponse(ResponseObject(id="x", model="m"), []))
    assert none.get("x") is None
