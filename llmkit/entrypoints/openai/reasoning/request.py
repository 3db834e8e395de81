"""One chat request's view of the server's reasoning parser: where its output starts (its
prompt decides), the output constraint moved past the thinking, and the split of its text."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmkit.entrypoints.openai.reasoning.base import (ReasoningParser, ReasoningSplit,
                                                      ReasoningStreamer, State)
from llmkit.sampling.params import StructuredOutputsParams

__all__ = ["RequestReasoning", "make_reasoning_parser"]


def make_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser | None:
    """The server's parser (``server.reasoning_parser``; None for ``none``)."""
    from llmkit.entrypoints.openai.reasoning import REASONING_PARSERS, check_reasoning_parser

    check_reasoning_parser(name)
    return None if name == "none" else REASONING_PARSERS.get(name)(tokenizer)


@dataclass(slots=True)
class RequestReasoning:
    parser: ReasoningParser
    state: State

    @classmethod
    def for_prompt(cls, parser: ReasoningParser, prompt_ids: list[int],
                   tokenizer: Any) -> "RequestReasoning":
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return cls(parser, parser.initial_state(text))

    def constrain(self, params: StructuredOutputsParams | None
                  ) -> StructuredOutputsParams | None:
        """``params`` applied to the answer: after the end marker, unless the prompt has
        already closed the thinking."""
        if params is None or self.state == "answer":
            return params
        end = self.parser.end_token_ids()
        if not end:
            return params
        return dataclasses.replace(params, reasoning_end_token_ids=end)

    def num_reasoning_tokens(self, token_ids: list[int], split: ReasoningSplit) -> int:
        """The output tokens up to and including the end marker's (all of them for an
        output cut off while thinking; none when it never thought)."""
        if split.reasoning is None:
            return 0
        end = self.parser.end_token_ids() or []
        n = len(end)
        for i in range(len(token_ids) - n + 1):
            if n and token_ids[i:i + n] == end:
                return i + n
        return len(token_ids)

    def split(self, text: str) -> ReasoningSplit:
        return self.parser.split(text, self.state)

    def streamer(self) -> ReasoningStreamer:
        return self.parser.streamer(self.state)
