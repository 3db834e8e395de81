"""Tool-call parsers by name (``server.tool_call_parser``; ``auto`` picks the model's format),
and the parsers for tool calls a grammar forced."""
from __future__ import annotations

from llmkit.entrypoints.openai.tool_parsers.base import (ParsedToolCall, ToolCallsOutput,
                                                         ToolParser)
from llmkit.entrypoints.openai.tool_parsers.forced import (NamedFunctionParser,
                                                           RequiredToolCallsParser)
from llmkit.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from llmkit.registry import Registry

TOOL_PARSERS: Registry = Registry("tool_parser")
TOOL_PARSERS.register("hermes")(HermesToolParser)

__all__ = ["NamedFunctionParser", "check_tool_call_parser", "ParsedToolCall", "RequiredToolCallsParser", "TOOL_PARSERS",
           "ToolCallsOutput", "ToolParser", "default_tool_parser"]


def default_tool_parser(chat_template: str | None) -> str:
    """The parser for a model's chat template: the Hermes format, which is also the format of
    the tool prompt llmkit adds to templates that know no tools (more formats join here)."""
    return "hermes"


def check_tool_call_parser(name: str) -> None:
    """A ``ConfigError`` naming ``server.tool_call_parser`` for an unknown parser."""
    from llmkit.config.errors import ConfigError

    if name != "auto" and name not in TOOL_PARSERS:
        raise ConfigError("server.tool_call_parser", name,
                          ", ".join(["auto", *TOOL_PARSERS.names()]))
