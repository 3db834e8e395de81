"""Bodies of ``POST /v1/responses`` (OpenAI's Responses API): the request, validated as
strictly as the chat endpoint's (unknown fields accepted and ignored), and the response object
with its output items. Streaming events are plain dicts (``responses.py``)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmkit.entrypoints.openai.protocol import _I64, _SEED_MAX, _SEED_MIN


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- input items

class InputMessage(_Request):
    """A turn: ``content`` as text or parts (``input_text``, ``output_text`` in an earlier
    assistant turn, ``input_image``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind in ("input_text", "output_text", "text"):
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"content part {i}: a {kind} part needs `text`")
                elif kind == "input_image":
                    if not isinstance(part.get("image_url"), str):
                        raise ValueError(f"content part {i}: an input_image part needs "
                                         "`image_url` (a data: or http(s) URL)")
                elif kind != "refusal":
                    raise ValueError(f"content part {i}: only input_text, output_text and "
                                     "input_image parts are supported")
        return v


class FunctionCallItem(_Request):
    """An earlier output's call (sent back with its result)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Request):
    """An earlier output's thinking: accepted, not put back into the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# --------------------------------------------------------------------------- tools, text

class FunctionTool(_Request):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


# --------------------------------------------------------------------------- the request

class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=_I64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    top_k: int | None = Field(None, ge=-1, le=_I64)
    priority: int = Field(0, ge=-_I64, le=_I64)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v


# --------------------------------------------------------------------------- the response

class OutputText(_Body):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Body):
    type: Literal["message"] = "message"
    id: str
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(_Body):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(_Body):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Body):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: str = "completed"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(_Body):
    cached_tokens: int = 0


class OutputTokensDetails(_Body):
    reasoning_tokens: int = 0


class ResponseUsage(_Body):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(_Body):
    reason: str


class ResponseObject(_Body):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
