"""Parsers for outputs a grammar forced into tool calls (``tool_choice`` ``required`` or a
named function): ``required`` writes Hermes blocks ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`` (``structured_output/tagged_calls.py``), a named function writes its
arguments object alone (vLLM's scheme).

A call cut by ``max_tokens`` is still a call: the grammar guarantees it was on its way to a
valid one, and the stream has already sent its name and argument text. So the final parse keeps
it with the argument text written so far, the same text the stream sent (issue 31: the stream
showed it while the complete response dropped it); the finish reason ``length`` says it is
cut."""
from __future__ import annotations

import json

from llmkit.entrypoints.openai.tool_parsers.base import (ParsedToolCall, ToolCallsOutput,
                                                         ToolParser, finalize_arguments)
from llmkit.entrypoints.openai.tool_parsers.hermes import CLOSE, OPEN
from llmkit.entrypoints.openai.tool_parsers.json_scan import read_call

__all__ = ["NamedFunctionParser", "RequiredToolCallsParser"]


class RequiredToolCallsParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ToolCallsOutput:
        calls: list[ParsedToolCall] = []
        pos = text.find(OPEN)
        while pos >= 0:
            start = pos + len(OPEN)
            end = text.find(CLOSE, start)
            block = text[start:end] if end >= 0 else text[start:]
            if end >= 0 and final:
                call = _complete_call(block)
                if call is None:  # cannot happen under the grammar; keep what is certain
                    break
                calls.append(call)
            else:
                partial = read_call(block)
                if not partial.valid or partial.name is None:
                    break  # its arguments wait for the name (streamed the same way)
                calls.append(ParsedToolCall(partial.name, partial.arguments or ""))
            if end < 0:
                break
            pos = text.find(OPEN, end + len(CLOSE))
        return ToolCallsOutput(content=None, tool_calls=calls)


def _complete_call(block: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = finalize_arguments(json.dumps(obj.get("arguments", {})))
    return ParsedToolCall(obj["name"], arguments) if arguments is not None else None


class NamedFunctionParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, *, final: bool) -> ToolCallsOutput:
        if not text.strip():
            return ToolCallsOutput(content=None)
        if not final:
            return ToolCallsOutput(None, [ParsedToolCall(self.name, text)])
        # Complete: compact JSON; cut short (max_tokens): the text so far, as streamed.
        arguments = finalize_arguments(text)
        return ToolCallsOutput(None, [ParsedToolCall(self.name, arguments
                                                     if arguments is not None else text)])
