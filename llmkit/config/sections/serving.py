"""What the front ends accept and default to: the server, ``llmkit generate`` / ``chat``,
images in prompts, and the engine's step trace."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from llmkit.config.sections.strict import _Strict

__all__ = [
    "ChatConfig", "MultiModalConfig", "ObservabilityConfig", "SamplingDefaults", "ServerConfig",
]


class SamplingDefaults(_Strict):
    """Defaults that `llmkit generate` / `chat` use for their SamplingParams (chat's reply
    length is ``chat.max_tokens``)."""

    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None


class ChatConfig(_Strict):
    """``llmkit chat``: a reply stops after ``max_tokens`` tokens (and says so), or earlier
    where the context (``model.max_model_len``) is full; the oldest turns are dropped (and
    the chat says so) when the conversation no longer leaves a reply
    ``min(max_tokens, max_model_len / 2)`` tokens of room."""

    max_tokens: int = Field(default=1024, ge=1)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None
    max_waiting_requests: int = Field(default=1024, ge=1)
    # On SIGINT/SIGTERM: seconds that requests in flight may take to finish before they are
    # aborted and the engine process is stopped.
    shutdown_timeout: float = Field(default=10.0, ge=0)
    # A request body larger than this is refused with 413 before it is read whole.
    max_request_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Origins whose pages may call the API from a browser (CORS), e.g. ["http://localhost:3000"];
    # ["*"] = any. Empty = same origin only (no CORS headers).
    allowed_origins: list[str] = Field(default_factory=list)
    # When the engine core process dies: start a new one and serve again (requests in flight
    # still fail). false = stay down (/health answers 503).
    restart_engine: bool = False
    # The engine core publishes at most this many per-step summaries a second (the /engine page,
    # GET /v1/engine/events); steps in between are counted, not sent. 0 = none.
    engine_events_per_s: float = Field(default=10.0, ge=0, le=1000)
    # How chat outputs become `tool_calls` (llmkit/entrypoints/openai/tool_parsers/): a
    # parser's name, or auto = the one for the model's format (Hermes `<tool_call>` when the
    # model names none).
    tool_call_parser: str = "auto"
    # How chat outputs split into thinking (`reasoning_content`) and answer `content`
    # (llmkit/entrypoints/openai/reasoning/): deepseek_r1, qwen3, or none (all `content`).
    reasoning_parser: str = "none"
    # POST /v1/responses keeps this many responses in memory (the oldest go first), for
    # `previous_response_id`; 0 = none are kept.
    responses_store_size: int = Field(default=1000, ge=0)
    # Hosts whose http(s) image URLs a chat request may name (fetched by the server), e.g.
    # ["images.example.com"]. Empty = none: images come as data: URLs.
    allowed_media_domains: list[str] = Field(default_factory=list)


class MultiModalConfig(_Strict):
    # An image larger than this (encoded bytes) is refused (HTTP 400).
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    # vLLM's limit_mm_per_prompt: the most items of each modality one prompt may carry.
    limit_mm_per_prompt: dict[Literal["image"], int] = Field(
        default_factory=lambda: {"image": 8})

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _non_negative(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if n < 0:
                raise ValueError(f"{k}: must be >= 0, got {n}")
        return v

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, 8)


class ObservabilityConfig(_Strict):
    # Write the engine's per-step stats (scheduled tokens, batch size, prefill/decode split,
    # step time) as a Chrome-trace JSON (open in https://ui.perfetto.dev) when the engine
    # shuts down. null = off (no cost).
    trace_file: str | None = None
    # keep at most this many steps (the first ones) in the trace
    trace_max_steps: int = Field(default=100_000, ge=1)
