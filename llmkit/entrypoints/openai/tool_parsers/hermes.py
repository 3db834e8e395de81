"""The Hermes format (NousResearch Hermes 2 Pro, Qwen 2.5, and llmkit's own tool prompt):

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>
"""
from __future__ import annotations

import json

from llmkit.entrypoints.openai.tool_parsers.base import (ParsedToolCall, ToolCallsOutput,
                                                         ToolParser, finalize_arguments)
from llmkit.entrypoints.openai.tool_parsers.json_scan import read_call

__all__ = ["HermesToolParser"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ToolCallsOutput:
        first = text.find(OPEN)
        if first < 0:
            if final:
                return ToolCallsOutput(content=text)
            # "<tool_c" at the end may become a tag: hold it back until it is known
            return ToolCallsOutput(content=text[:len(text) - _partial_tag_suffix(text, OPEN)])
        content = text[:first]
        blocks = []
        pos = first
        while pos >= 0:
            start = pos + len(OPEN)
            end = text.find(CLOSE, start)
            blocks.append(text[start:end] if end >= 0 else text[start:])
            pos = text.find(OPEN, end + len(CLOSE)) if end >= 0 else -1
        if not final:
            calls = []
            for block in blocks:
                c = read_call(block)
                if not c.valid:
                    break
                calls.append(ParsedToolCall(c.name, c.arguments or ""))
            return ToolCallsOutput(content=content, tool_calls=calls)
        calls = []
        for block in blocks:
            try:
                obj = json.loads(block)
            except json.JSONDecodeError:
                return ToolCallsOutput(content=text)  # not a valid call: it is all text
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ToolCallsOutput(content=text)
            args = obj.get("arguments", obj.get("parameters", {}))
            arguments = finalize_arguments(json.dumps(args))
            if arguments is None:
                return ToolCallsOutput(content=text)
            calls.append(ParsedToolCall(obj["name"], arguments))
        return ToolCallsOutput(content=content if content.strip() else None, tool_calls=calls)
