"""Request and response bodies of the OpenAI-compatible API (OpenAI's field names and ranges,
plus vLLM's sampling extras).

Requests validate strictly (a string where a number belongs is a 400, not a silent
conversion) and name the offending field in the error's ``param``. Unknown fields are accepted
and ignored, as vLLM does (clients send provider-specific extras); the server logs them once.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# torch.Generator seeds are 64-bit.
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1
# Integers cross to the engine core as msgpack: beyond 64 bits they cannot (a 400, not a 500).
_I64 = 2 ** 63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- errors

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- shared

class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Request):
    """``response_format.json_schema``: OpenAI's named schema (``schema`` is the JSON schema;
    the output always follows it, ``strict`` or not)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema.schema (a JSON schema)")
        return self


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """Fields that both endpoints share (they map onto ``SamplingParams`` by name)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=_I64)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_I64)
    priority: int = Field(0, ge=-_I64, le=_I64)
    # vLLM's: requests with different salts share no prefix-cache blocks (tenant isolation)
    cache_salt: str | None = Field(None, min_length=1)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and the older
    # guided_* names many clients still send (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: disaggregated serving's hand-over between a prefill and a decode engine
    # (``{"do_remote_decode": true}`` asks a producer to keep the KV; a producer's response
    # carries what a consumer needs to load it)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
        chunk carries the usage so far, so a client can count the tokens of each chunk."""
        return self.include_usage and self.stream_options.continuous_usage_stats


# --------------------------------------------------------------------------- completions

class CompletionRequest(SamplingFields):
    # An example in the OpenAPI schema: docs show it, and the server fuzz sends it first.
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 8}]})
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    # vLLM's beam search (``n`` is the beam width; entrypoints/openai/completions.py)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id lists must not be empty")
            flat = v if isinstance(v[0], int) else [t for p in v if isinstance(p, list) for t in p]
            if any(t < 0 for t in flat):
                raise ValueError("token ids must be >= 0")
        return v


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


# --------------------------------------------------------------------------- chat

class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # assistant turns that called tools, and the tool results that answer them
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind == "image_url":
                    spec = part.get("image_url")
                    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                        raise ValueError(f"content part {i}: an image_url part is "
                                         "{'type': 'image_url', 'image_url': {'url': ...}}")
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i}: only {{'type': 'text', 'text': ...}} "
                                     "and {'type': 'image_url', ...} parts are supported")
        return v

    @model_validator(mode="after")
    def _content_given(self):
        # OpenAI (and vLLM) answer 400 for a turn without content; only an assistant turn
        # that calls tools may leave it null (issue 31.10: a null user turn was answered).
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            needs = "content (or tool_calls)" if self.role == "assistant" else "content"
            raise ValueError(f"a {self.role} message needs {needs}; got null")
        return self

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") == "image_url"
                                                      for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    # None = "auto" when tools are given, else "none" (OpenAI's default)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class ChatLogprobTop(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    # The thinking (server.reasoning_parser), under vLLM's two names for it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------- models

class SamplingDefaults(_Response):
    """What the server applies to a request that leaves a sampling field out: the model's
    recommended values (``model.generation_config``) over ``SamplingParams``' own -- so a
    client (the chat page) can start its controls where the server starts."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    # The model's cap on a request's max_tokens; None: no cap but max_model_len.
    max_tokens: int | None = None
    # The fields above that the model states (the rest are SamplingParams' defaults).
    from_model: list[str] = Field(default_factory=list)


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmkit"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None
    # llmkit's extension (an adapter shares its base model's defaults).
    sampling_defaults: SamplingDefaults | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and
    ignored: the name identifies the adapter)."""

    lora_name: str
    lora_int_id: int | None = None


# --------------------------------------------------------------------------- tokenize

class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
