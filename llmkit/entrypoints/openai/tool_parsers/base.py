"""Tool-call parsers: a chat output's text → content and tool calls (OpenAI's ``tool_calls``).

``parse(text, final=...)`` reads the whole text so far. While streaming (``final=False``) it
returns what is certain: content that cannot turn out to be the start of a tool call, and per
call its name once complete and its argument text as far as it goes — each a prefix of what a
longer text gives, so ``ToolCallStreamer`` can send the growth as OpenAI deltas. With
``final=True`` the calls are complete, parsed JSON (their arguments re-serialized), or the
whole text is content when the output holds no valid call.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

__all__ = ["ParsedToolCall", "ToolCallsOutput", "ToolParser", "finalize_arguments"]


@dataclass(slots=True)
class ParsedToolCall:
    name: str | None  # None while streaming, until the name is complete
    arguments: str  # JSON text (a prefix of it while streaming)


@dataclass(slots=True)
class ToolCallsOutput:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Parses one chat output (one choice); stateless between calls."""

    @abstractmethod
    def parse(self, text: str, *, final: bool) -> ToolCallsOutput: ...


def finalize_arguments(raw: str | None) -> str | None:
    """Complete argument text as compact JSON of an object; None if it is not one (a
    JSON string holding an object is unwrapped, as some models write that)."""
    if raw is None:
        return "{}"
    try:
        value = json.loads(raw)
        if isinstance(value, str):
            value = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)
