"""Reasoning parsers: a chat output's text → its thinking (``reasoning_content``) and its
answer (``content``), vLLM's ``--reasoning-parser`` (``server.reasoning_parser``).

A parser names its markers (``<think>`` / ``</think>``) and whether text before the end marker
is thinking even when the start marker never came (``implicit_start``: DeepSeek-R1's template
puts ``<think>`` in the prompt). The split is done on text, so a marker split across streamed
deltas (or written as several tokens) is still found: ``ReasoningStreamer`` holds back a tail
that may be the start of a marker until the next delta says whether it is one. The streamed
pieces concatenate to exactly what ``split`` gives for the whole text.

The prompt decides where the output starts (vLLM's ``is_reasoning_end`` on the prompt): its
last marker is the end marker (``enable_thinking=false`` templates close an empty thinking
block) → the output is all answer; the start marker → the output starts inside the thinking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ReasoningParser", "ReasoningStreamer", "ReasoningSplit"]

State = Literal["start", "thinking", "answer"]


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output never entered a thinking block
    content: str | None  # None: no answer text (yet)


class ReasoningParser:
    """Stateless; ``streamer()`` makes the per-choice state."""

    name: str = ""
    start_marker: str = "<think>"
    end_marker: str = "</think>"
    # Text before the end marker is thinking even without the start marker.
    implicit_start: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    # -- the prompt --------------------------------------------------------------------------
    def initial_state(self, prompt_text: str) -> State:
        """Where an output that follows ``prompt_text`` starts."""
        start, end = prompt_text.rfind(self.start_marker), prompt_text.rfind(self.end_marker)
        if end > start:
            return "answer"
        if start > end:  # (-1 when absent)
            return "thinking"
        return "start"

    def end_token_ids(self) -> list[int] | None:
        """The end marker's token ids (what the engine watches for before it applies an
        output constraint), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return list(self.tokenizer.encode(self.end_marker, add_special_tokens=False))

    # -- the output --------------------------------------------------------------------------
    def streamer(self, state: State = "start") -> "ReasoningStreamer":
        return ReasoningStreamer(self, state)

    def split(self, text: str, state: State = "start") -> ReasoningSplit:
        """The whole output's thinking and answer."""
        s = self.streamer(state)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning = r1 + r2 if s.entered_thinking else None
        return ReasoningSplit(reasoning, (c1 + c2) or None)


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that starts ``marker`` (and is shorter)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamer:
    """One choice's output, fed delta by delta: each ``feed`` returns the (reasoning,
    content) text that is certain now; ``finish`` flushes what was held back."""

    def __init__(self, parser: ReasoningParser, state: State = "start") -> None:
        self.parser = parser
        self.state: State = state
        self.entered_thinking = state == "thinking"
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        p = self.parser
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        while text:
            if self.state == "start":
                if text.startswith(p.start_marker):
                    text = text[len(p.start_marker):]
                    self._enter_thinking()
                elif p.start_marker.startswith(text):
                    self._held = text  # maybe the start marker: wait for more
                    text = ""
                elif p.implicit_start:
                    self._enter_thinking()
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                i = text.find(p.end_marker)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(p.end_marker):]
                    self.state = "answer"
                else:
                    n = _held_prefix(text, p.end_marker)
                    reasoning.append(text[:len(text) - n])
                    self._held = text[len(text) - n:]
                    text = ""
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back tail: a partial end marker is thinking; a partial start marker is
        thinking for ``implicit_start`` parsers, else answer."""
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self.state == "thinking" or (self.state == "start" and self.parser.implicit_start):
            self._enter_thinking()
            return held, ""
        return "", held

    def _enter_thinking(self) -> None:
        self.state = "thinking"
        self.entered_thinking = True
