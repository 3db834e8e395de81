"""``POST /v1/responses`` (OpenAI's Responses API) over the chat path: the request becomes a chat
request (``input`` and ``instructions`` → messages, ``text.format`` → ``response_format``,
flat function ``tools`` → chat tools), which goes through the same template, tool use,
structured output, reasoning split and engine as ``/v1/chat/completions``; the output becomes
Responses output items (``reasoning``, ``function_call``, ``message``), streamed as OpenAI's
typed events, each with a ``sequence_number``. ``previous_response_id`` continues a
conversation kept in memory (``responses_store.py``); ``GET /v1/responses/{id}`` reads one.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from llmkit.engine.async_llm import EngineDeadError, RequestStream
from llmkit.entrypoints.openai.chat_prompt import ToolUse
from llmkit.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead, refused
from llmkit.entrypoints.openai.protocol import ChatCompletionRequest
from llmkit.entrypoints.openai.reasoning.request import RequestReasoning
from llmkit.entrypoints.openai.responses_protocol import (IncompleteDetails, InputMessage,
                                                          OutputFunctionCall, OutputMessage,
                                                          OutputReasoning, OutputText,
                                                          ReasoningText, ResponseObject,
                                                          ResponsesRequest, ResponseUsage)
from llmkit.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from llmkit.entrypoints.openai.serving import OpenAIServing, _chat_message
from llmkit.entrypoints.openai.streaming import (EngineStreamingResponse, abort_all, collect,
                                                 merge, run_until_disconnect)
from llmkit.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer

__all__ = ["OpenAIServingResponses", "add_responses_routes"]

# The chat request's field names in errors → the Responses request's.
_PARAMS = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- input → chat

def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (an earlier output's calls join one assistant turn; their
    results are tool turns; earlier thinking is left out, as chat templates leave it)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _chat_content(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and not out[-1].get("content"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for p in content:
        if p["type"] == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        elif p["type"] != "refusal":
            parts.append({"type": "text", "text": p["text"]})
    return parts


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates this response (a 400 naming the Responses field for
    what the chat path refuses)."""
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls, "priority": req.priority}
    for name in ("temperature", "top_p", "seed", "top_k", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type"}, by_alias=True)} for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("text.format of type json_schema needs `schema`", "text")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.json_schema,
            **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = _PARAMS.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{'.'.join(loc)}: {err.get('msg', 'invalid value')}", param) from None


# --------------------------------------------------------------------------- the endpoint

class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing, store_size: int) -> None:
        self.serving = serving
        self.store = ResponsesStore(store_size)

    def retrieve(self, response_id: str) -> ResponseObject:
        item = self.store.get(response_id)
        if item is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.",
                              param="response_id", code="response_not_found")
        return item.response

    async def create(self, req: ResponsesRequest, raw_request: Request):
        try:
            return await self._create(req, raw_request)
        except OpenAIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise

    async def _create(self, req: ResponsesRequest, raw_request: Request):
        s = self.serving
        s._warn_extra(req)
        lora = s.check_model(req.model)
        s.check_engine()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise bad_request(f"Previous response with id '{req.previous_response_id}' "
                                  "not found (responses are kept in memory, the latest "
                                  "server.responses_store_size of them).",
                                  "previous_response_id")
            history = prev.conversation
        turn = input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = await s.chat_prompt(chat_request(req, system + history + turn))
        use, thinking, num_prompt_tokens = chat.use, chat.thinking, chat.num_prompt_tokens
        s._check_length(num_prompt_tokens, req.max_output_tokens, "input")
        params = s.sampling_params(chat.request, max_tokens=req.max_output_tokens,
                                   logprobs=None, structured_outputs=chat.structured)
        response_id = _new_id("resp")
        streams = await s._start(response_id, [chat.prompt], [None], params, 1,
                                 chat.request.priority, req.stream, None, lora)
        base = self._skeleton(req, response_id, s.response_model(lora))
        conversation = history + turn
        if req.stream:
            return EngineStreamingResponse(
                self._events(req, base, streams, num_prompt_tokens, use, thinking,
                             conversation),
                on_close=lambda: abort_all(streams))
        results = await run_until_disconnect(raw_request, collect(streams),
                                             lambda: abort_all(streams))
        if isinstance(results, Response):
            return results
        ro = results[0]
        c = ro.outputs[0]
        message, finish_reason = _chat_message(c.text, c.finish_reason, use, thinking)
        output: list[Any] = []
        if message.reasoning_content is not None:
            output.append(OutputReasoning(id=_new_id("rs"), content=[
                ReasoningText(text=message.reasoning_content)]))
        for call in message.tool_calls:
            output.append(OutputFunctionCall(id=_new_id("fc"), call_id=call.id,
                                             name=call.function.name,
                                             arguments=call.function.arguments))
        if message.content or not message.tool_calls:
            output.append(OutputMessage(id=_new_id("msg"), content=[
                OutputText(text=message.content or "")]))
        response = self._finish(base, output, finish_reason, len(ro.prompt_token_ids),
                                len(c.token_ids), ro.num_cached_tokens,
                                _reasoning_tokens(thinking, c.token_ids, c.text))
        self._keep(req, response, conversation)
        return response

    # -- the response object ---------------------------------------------------------------
    @staticmethod
    def _skeleton(req: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        choice = req.tool_choice
        return ResponseObject(
            id=response_id, status="in_progress", model=model, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=(choice if isinstance(choice, str) or choice is None
                         else choice.model_dump()) or ("auto" if req.tools else "none"),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
            text={"format": fmt}, store=req.store, metadata=dict(req.metadata or {}),
            user=req.user)

    @staticmethod
    def _finish(base: ResponseObject, output: list[Any], finish_reason: str | None,
                input_tokens: int, output_tokens: int, cached: int,
                reasoning_tokens: int = 0) -> ResponseObject:
        incomplete = finish_reason == "length"
        return base.model_copy(update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if incomplete else None,
            "output": output,
            "usage": ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                                   total_tokens=input_tokens + output_tokens,
                                   input_tokens_details={"cached_tokens": cached},
                                   output_tokens_details={"reasoning_tokens": reasoning_tokens})
        })

    def _keep(self, req: ResponsesRequest, response: ResponseObject,
              conversation: list[dict[str, Any]]) -> None:
        """Store the response with its conversation (its output as the assistant's turn)."""
        if not req.store:
            return
        text = "".join(part.text for item in response.output
                       if isinstance(item, OutputMessage) for part in item.content)
        calls = [{"id": item.call_id, "type": "function",
                  "function": {"name": item.name, "arguments": item.arguments}}
                 for item in response.output if isinstance(item, OutputFunctionCall)]
        turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        self.store.put(StoredResponse(response, [*conversation, turn]))

    # -- streaming -------------------------------------------------------------------------
    async def _events(self, req: ResponsesRequest, base: ResponseObject,
                      streams: list[RequestStream], num_prompt_tokens: int, use: ToolUse,
                      thinking: RequestReasoning | None,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.emit("response.created", response=base.model_dump(mode="json"))
        yield events.emit("response.in_progress", response=base.model_dump(mode="json"))
        tools = ToolCallStreamer(use.parser) if use.parser is not None else None
        thinker = thinking.streamer() if thinking is not None else None
        cached, finish_reason = 0, None
        token_ids: list[int] = []
        text_so_far: list[str] = []
        try:
            async for _p, ro in merge(streams):
                cached = ro.num_cached_tokens
                for c in ro.outputs:
                    token_ids += c.token_ids
                    text_so_far.append(c.text)
                    finished = c.finish_reason is not None
                    text, reasoning = c.text, ""
                    if thinker is not None:
                        reasoning, text = thinker.feed(c.text)
                        if finished:
                            more_reasoning, more_text = thinker.finish()
                            reasoning, text = reasoning + more_reasoning, text + more_text
                    if reasoning:
                        for e in events.reasoning(reasoning):
                            yield e
                    delta = tools.feed(text, finished) if tools is not None else \
                        ({"content": text} if text else {})
                    if delta.get("content"):
                        for e in events.text(delta["content"]):
                            yield e
                    for call in delta.get("tool_calls", ()):
                        for e in events.tool_call(call):
                            yield e
                    if finished:
                        finish_reason = c.finish_reason
        except EngineDeadError as e:
            yield events.error(engine_dead(e))
            return
        except ValueError as e:  # the engine refused the request
            yield events.error(refused(e))
            return
        for e in events.close():
            yield e
        if not any(item.type in ("message", "function_call") for item in events.output):
            for e in [*events.text(""), *events.close()]:
                yield e
        response = self._finish(base, events.output, finish_reason, num_prompt_tokens,
                                len(token_ids), cached,
                                _reasoning_tokens(thinking, token_ids, "".join(text_so_far)))
        self._keep(req, response, conversation)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield events.emit(kind, response=response.model_dump(mode="json"))


def _reasoning_tokens(thinking: RequestReasoning | None, token_ids: list[int],
                      text: str) -> int:
    if thinking is None:
        return 0
    return thinking.num_reasoning_tokens(list(token_ids), thinking.split(text))


class _EventWriter:
    """The typed events of one streamed response: output items opened as their first
    delta arrives and closed (with their ``.done`` events) when another kind starts."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[Any] = []
        self._open: Any = None  # the item being written
        self._text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def error(self, err: OpenAIError) -> str:
        return self.emit("error", code=err.code, message=err.message, param=err.param)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open.id, "output_index": len(self.output)}

    def _start(self, item: Any, part: dict[str, Any] | None) -> list[str]:
        out = self.close()
        self._open, self._text = item, ""
        out.append(self.emit("response.output_item.added", output_index=len(self.output),
                             item=item.model_dump(mode="json")))
        if part is not None:
            out.append(self.emit("response.content_part.added", **self._where(),
                                 content_index=0, part=part))
        return out

    def text(self, delta: str) -> list[str]:
        out: list[str] = []
        if not isinstance(self._open, OutputMessage):
            out = self._start(OutputMessage(id=_new_id("msg"), status="in_progress",
                                            content=[]),
                              {"type": "output_text", "text": "", "annotations": [],
                               "logprobs": []})
        self._text += delta
        if delta:
            out.append(self.emit("response.output_text.delta", **self._where(),
                                 content_index=0, delta=delta, logprobs=[]))
        return out

    def reasoning(self, delta: str) -> list[str]:
        out: list[str] = []
        if not isinstance(self._open, OutputReasoning):
            out = self._start(OutputReasoning(id=_new_id("rs"), status="in_progress",
                                              content=[]),
                              {"type": "reasoning_text", "text": ""})
        self._text += delta
        out.append(self.emit("response.reasoning_text.delta", **self._where(),
                             content_index=0, delta=delta))
        return out

    def tool_call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = call.get("function") or {}
        if "id" in call:  # a new call: its name comes whole, its arguments in pieces
            out = self._start(OutputFunctionCall(id=_new_id("fc"), call_id=call["id"],
                                                 name=fn["name"], arguments="",
                                                 status="in_progress"), None)
        if fn.get("arguments"):
            self._text += fn["arguments"]
            out.append(self.emit("response.function_call_arguments.delta", **self._where(),
                                 delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        """The ``.done`` events of the item being written, which joins ``output``."""
        item, text = self._open, self._text
        if item is None:
            return []
        where = self._where()
        out: list[str] = []
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            out.append(self.emit("response.output_text.done", **where, content_index=0,
                                 text=text, logprobs=[]))
            out.append(self.emit("response.content_part.done", **where, content_index=0,
                                 part=part.model_dump(mode="json")))
            done = item.model_copy(update={"status": "completed", "content": [part]})
        elif isinstance(item, OutputReasoning):
            part = ReasoningText(text=text)
            out.append(self.emit("response.reasoning_text.done", **where, content_index=0,
                                 text=text))
            out.append(self.emit("response.content_part.done", **where, content_index=0,
                                 part=part.model_dump(mode="json")))
            done = item.model_copy(update={"status": "completed", "content": [part]})
        else:
            out.append(self.emit("response.function_call_arguments.done", **where,
                                 name=item.name, arguments=text))
            done = item.model_copy(update={"status": "completed", "arguments": text})
        out.append(self.emit("response.output_item.done", output_index=where["output_index"],
                             item=done.model_dump(mode="json")))
        self.output.append(done)
        self._open, self._text = None, ""
        return out


# --------------------------------------------------------------------------- routes

def add_responses_routes(app: FastAPI, serving: OpenAIServing, store_size: int,
                         errors: dict[int | str, dict[str, Any]]) -> OpenAIServingResponses:
    responses = OpenAIServingResponses(serving, store_size)
    generation = {**errors, 200: {
        "description": "A response object, or its typed server-sent events when `stream` "
                       "is true", "content": {"text/event-stream": {}}}}

    @app.post("/v1/responses", responses=generation)
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=errors)
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    return responses
