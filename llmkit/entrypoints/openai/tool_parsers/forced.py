"""Parsers for outputs a grammar forced into tool calls (``tool_choice`` ``required`` or a
named function; vLLM's scheme): ``required`` writes a JSON array ``[{"name": ..., "parameters":
{...}}, ...]``, a named function writes its arguments object alone."""
from __future__ import annotations

from llmkit.entrypoints.openai.tool_parsers.base import (ParsedToolCall, ToolCallsOutput,
                                                         ToolParser, finalize_arguments)
from llmkit.entrypoints.openai.tool_parsers.json_scan import read_call, scan_value, skip_ws

__all__ = ["NamedFunctionParser", "RequiredToolCallsParser"]


class RequiredToolCallsParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ToolCallsOutput:
        calls: list[ParsedToolCall] = []
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ToolCallsOutput(content=text if final and text.strip() else None)
        i += 1
        while True:
            i = skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            if i >= len(text) or text[i] != "{":
                break
            end = scan_value(text, i)
            call = read_call(text[:end] if end is not None else text, i)
            if end is None:  # still being written
                if not final:
                    calls.append(ParsedToolCall(call.name, call.arguments or ""))
                break
            arguments = finalize_arguments(call.arguments) if final else call.arguments
            if call.name is None or arguments is None:
                break
            calls.append(ParsedToolCall(call.name, arguments))
            i = end
        return ToolCallsOutput(content=None, tool_calls=calls)


class NamedFunctionParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, *, final: bool) -> ToolCallsOutput:
        if not final:
            return ToolCallsOutput(None, [ParsedToolCall(self.name, text)] if text.strip()
                                   else [])
        arguments = finalize_arguments(text) if text.strip() else None
        if arguments is None:  # cut short (max_tokens): no complete call
            return ToolCallsOutput(content=text or None)
        return ToolCallsOutput(None, [ParsedToolCall(self.name, arguments)])
