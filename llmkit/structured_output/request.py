"""A request's structured-output state: its spec's key, the compilation it waits for, then its
own grammar matcher (vLLM's ``StructuredOutputRequest``)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from llmkit.structured_output.base import StructuredOutputGrammar, StructuredOutputKey

__all__ = ["StructuredOutputRequest"]


@dataclass(slots=True)
class StructuredOutputRequest:
    key: StructuredOutputKey
    # The shared compilation (a compiled grammar), done in the manager's thread pool.
    compiled: Future[Any]
    # This request's matcher, made when the compilation is done; None until then.
    grammar: StructuredOutputGrammar | None = None
    # Why the grammar could not be made (the request then fails with this message).
    error: str | None = None
    # The grammar waits until the output has written these tokens (a reasoning model's end of
    # thinking; None: it applies from the first token), and the output's last tokens seen
    # while waiting (to find a marker of several tokens).
    reasoning_end: tuple[int, ...] | None = None
    recent: list[int] = field(default_factory=list)

    @property
    def reasoning(self) -> bool:
        """Still in the thinking: the grammar neither constrains nor follows the output."""
        return self.reasoning_end is not None

    def reasoning_ends_at(self, tokens: list[int]) -> int | None:
        """The index of the token of ``tokens`` that would complete the end marker (None:
        the thinking goes on past them); nothing is consumed."""
        end = self.reasoning_end
        seen = list(self.recent)
        for i, tok in enumerate(tokens):
            seen.append(tok)
            if tuple(seen[-len(end):]) == end:
                return i
        return None

    def see_reasoning_token(self, tok: int) -> bool:
        """Follow one output token while thinking; True when it completes the end marker
        (the grammar applies from the next token)."""
        end = self.reasoning_end
        self.recent.append(tok)
        del self.recent[:-len(end)]
        if tuple(self.recent) == end:
            self.reasoning_end = None
            self.recent.clear()
            return True
        return False
