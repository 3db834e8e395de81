"""A chat request as the engine's prompt (``/v1/chat/completions``, ``/v1/responses``,
``/tokenize`` with ``messages``): its tool use, its images and the model's chat template. The
engine's ``Frontend`` renders the messages and decodes their images; this module turns what it
refuses into a 400 naming ``messages`` and adds the server's own parts (tools,
``chat_template_kwargs``, ``continue_final_message``).

Tools: what ``tool_choice`` asks for, the grammar that forces tool calls, and the conversation
as the chat template receives it.

- ``none``: no tools in the prompt, plain content. ``auto`` (the default with tools): the
  tools are in the prompt; the tool-call parser (``server.tool_call_parser``) finds calls in
  the output. ``required`` / a named function: the output is forced by a JSON schema built
  from the functions' ``parameters``, so the calls always parse and validate: ``required``
  writes the Hermes blocks the tool prompt teaches (``<tool_call>\n{"name": ..., "arguments":
  {...}}\n</tool_call>``; one block unless ``parallel_tool_calls``, and the output may end
  after any complete block: see ``structured_output/tagged_calls.py`` for why not vLLM's
  JSON array), a named function writes its arguments object (vLLM's scheme).
- A template that renders ``tools`` gets them (and assistant ``tool_calls`` with arguments as
  objects). A template that knows no tools — SmolLM2's ignores them and fails on an assistant
  turn without content — gets ``TOOL_PROMPT`` (Hermes-style) in the system message, the
  assistant's calls written as ``<tool_call>`` blocks and tool results as ``<tool_response>``
  user turns.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable

from llmkit.engine.frontend import Frontend
from llmkit.entrypoints.openai.errors import bad_request
from llmkit.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage, ChatTool,
                                                TokenizeRequest)
from llmkit.entrypoints.openai.tool_parsers import (NamedFunctionParser, RequiredToolCallsParser,
                                                    ToolParser)
from llmkit.sampling.params import StructuredOutputsParams
from llmkit.structured_output.tagged_calls import tagged_calls_grammar

__all__ = ["TOOL_PROMPT", "ChatRequest", "ToolUse", "load_chat_images", "render_chat_prompt",
           "template_messages", "template_supports_tools", "tool_use"]

ChatRequest = ChatCompletionRequest | TokenizeRequest


TOOL_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures are listed as JSON \
between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, answer with one JSON object per call, holding the function's name and \
its arguments, each between <tool_call> and </tool_call>:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


@dataclass(slots=True)
class ToolUse:
    """How one chat request uses tools."""

    mode: str  # none | auto | required | named
    tools: list[ChatTool]
    # The parser of this request's output (None: no tool calls possible).
    parser: ToolParser | None = None
    # The grammar that forces the calls (required / named).
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def in_prompt(self) -> bool:
        return self.mode != "none" and bool(self.tools)


def tool_use(req: ChatCompletionRequest, auto_parser: ToolParser, *,
             any_whitespace: bool = True) -> ToolUse:
    """The request's tool mode; a 400 for a ``tool_choice`` that cannot be met.
    ``any_whitespace``: free whitespace in forced calls' JSON (the engine's
    ``structured_output.disable_any_whitespace`` negated: the grammar is built here)."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolUse("none", tools)
    if not tools:
        raise bad_request(f"tool_choice {_shown(choice)} needs `tools`", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("`tools` must have distinct function names", "tools")
    if choice == "auto":
        return ToolUse("auto", tools, parser=auto_parser)
    if choice == "required":
        schema: dict[str, Any] = {"anyOf": [_call_schema(t) for t in tools]}
        defs = _shared_defs(tools)
        if defs:
            schema["$defs"] = defs
        try:
            grammar = tagged_calls_grammar(schema, parallel=req.parallel_tool_calls,
                                           any_whitespace=any_whitespace)
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
        return ToolUse("required", tools, parser=RequiredToolCallsParser(),
                       structured_outputs=StructuredOutputsParams(grammar=grammar))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names function {name!r}, which is not in `tools` "
                          f"({', '.join(names)})", "tool_choice")
    return ToolUse("named", [tool], parser=NamedFunctionParser(name),
                   structured_outputs=StructuredOutputsParams(json=_parameters(tool)))


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _call_schema(tool: ChatTool) -> dict[str, Any]:
    params = {k: v for k, v in _parameters(tool).items() if k != "$defs"}
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "arguments": params},
            "required": ["name", "arguments"]}


def _shared_defs(tools: list[ChatTool]) -> dict[str, Any]:
    """The functions' ``$defs``, moved to the call schema's root (where their ``$ref``s point)."""
    defs: dict[str, Any] = {}
    for t in tools:
        for name, schema in (_parameters(t).get("$defs") or {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(f"tools: two functions define $defs.{name} differently",
                                  "tools")
            defs[name] = schema
    return defs


# --------------------------------------------------------------------------- the conversation

def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (it reads the variable)."""
    return bool(chat_template) and "tools" in chat_template


def template_messages(req: ChatCompletionRequest, use: ToolUse,
                      native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation for ``apply_chat_template`` and its extra keyword arguments."""
    if native:
        messages = [_native_message(m) for m in req.messages]
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in use.tools]} \
            if use.in_prompt else {}
        return messages, kwargs
    messages = [_plain_message(m) for m in req.messages]
    if use.in_prompt:
        listing = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                            for t in use.tools)
        prompt = TOOL_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            messages[0] = {**first, "content": f"{first['content']}\n\n{prompt}"
                           if first["content"] else prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def _base(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _native_message(m: ChatMessage) -> dict[str, Any]:
    out = _base(m)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _plain_message(m: ChatMessage) -> dict[str, Any]:
    """A message for a template without tool support: calls and results as Hermes text."""
    out = _base(m)
    if m.role == "assistant" and m.tool_calls:
        blocks = [json.dumps({"name": c.function.name,
                              "arguments": _arguments_object(c.function.arguments)},
                             ensure_ascii=False) for c in m.tool_calls]
        text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        out["content"] = f"{out['content']}\n{text}" if out["content"] else text
    elif m.role == "tool":
        out = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    return out


# --------------------------------------------------------------------------- the prompt

def render_chat_prompt(frontend: Frontend, req: ChatRequest, use: ToolUse | None,
                       template_has_tools: bool,
                       encode: Callable[..., list[int]]) -> list[int]:
    """The token ids of the request's messages as the chat template renders them
    (``encode(text, param, **kwargs)`` tokenizes, with a 400 for text it cannot take)."""
    if not frontend.has_chat_template:
        raise bad_request("this model has no chat template; use /v1/completions",
                          "messages")
    messages, tool_kwargs = template_messages(req, use or ToolUse("none", []),
                                              native=template_has_tools)
    is_chat = isinstance(req, ChatCompletionRequest)  # /tokenize has no template options
    kwargs = {**tool_kwargs, **dict((req.chat_template_kwargs if is_chat else None) or {})}
    continue_final = is_chat and req.continue_final_message
    add_gen = req.add_generation_prompt and not continue_final
    try:
        text = frontend.render_chat(messages, add_generation_prompt=add_gen,
                                    continue_final_message=continue_final, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input
        raise bad_request(f"the chat template failed on these messages: {e}",
                          "messages") from None
    ids = encode(text, "messages", add_special_tokens=False)
    if not ids:
        raise bad_request("the conversation is empty (no tokens)", "messages")
    return ids


async def load_chat_images(frontend: Frontend, req: ChatRequest) -> tuple[ChatRequest, list]:
    """The request with each image content part replaced by the model's placeholder, and
    the images (decoded here: a bad one is a 400 before the engine sees anything)."""
    if not any(m.has_images for m in req.messages):
        return req, []
    try:
        # In a thread: decoding (and fetching from an allowed host) must not stall the
        # event loop that streams other requests.
        messages, images = await asyncio.to_thread(
            frontend.split_images, [m.model_dump(exclude_none=True) for m in req.messages])
    except ValueError as e:  # ImageError, and the frontend's limits
        raise bad_request(str(e), "messages") from None
    return req.model_copy(update={"messages": [ChatMessage(**m) for m in messages]}), images
