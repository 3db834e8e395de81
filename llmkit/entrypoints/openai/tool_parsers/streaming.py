"""``ToolCallStreamer``: one choice's growing text → OpenAI chat deltas (``content``, and
``tool_calls`` entries: ``index``, ``id``, ``type`` and ``function.name`` first, then
``function.arguments`` fragments), by diffing successive parses of the whole text.

Argument fragments are the output's own text, so they concatenate to the call's JSON exactly;
the last feed (``finished``) also parses the text as complete (``final``), which says whether
tools were called at all."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from llmkit.entrypoints.openai.tool_parsers.base import ToolCallsOutput, ToolParser

__all__ = ["ToolCallStreamer", "new_tool_call_id"]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: str = ""  # argument text sent so far


@dataclass
class ToolCallStreamer:
    parser: ToolParser
    text: str = ""
    content_sent: str = ""
    calls: list[_SentCall] = field(default_factory=list)
    final: ToolCallsOutput | None = None  # the parse of the complete output, once finished

    def feed(self, delta: str, finished: bool) -> dict:
        """The chat delta for ``delta`` (``{}`` when nothing is certain yet)."""
        self.text += delta
        parsed = self.parser.parse(self.text, final=False)
        content = parsed.content or ""
        if finished:
            self.final = self.parser.parse(self.text, final=True)
            if not self.final.tool_calls:
                content = self.final.content or ""  # also what was held back
        out: dict = {}
        if len(content) > len(self.content_sent) and content.startswith(self.content_sent):
            out["content"] = content[len(self.content_sent):]
            self.content_sent = content
        deltas: list[dict] = []
        for i, call in enumerate(parsed.tool_calls):
            if call.name is None:
                break  # its arguments wait for the name
            if i == len(self.calls):
                self.calls.append(_SentCall(new_tool_call_id()))
                deltas.append({"index": i, "id": self.calls[i].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[i]
            if len(call.arguments) > len(sent.arguments) and \
                    call.arguments.startswith(sent.arguments):
                deltas.append({"index": i, "function": {
                    "arguments": call.arguments[len(sent.arguments):]}})
                sent.arguments = call.arguments
        if deltas:
            out["tool_calls"] = deltas
        return out

    @property
    def tools_called(self) -> bool:
        """Once finished: whether the output holds tool calls."""
        return bool(self.final is not None and self.final.tool_calls)
