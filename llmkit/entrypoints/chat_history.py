"""A terminal chat's conversation, kept within the model's context: when the prompt of the
whole conversation leaves the reply too little room, the oldest turns are dropped (system
messages stay) until it fits."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

Message = dict[str, str]


@dataclass(slots=True)
class FittedPrompt:
    """The prompt of the conversation as it now stands (``None``: its last message alone does
    not fit) and how many of the oldest turns were dropped to get there."""

    token_ids: list[int] | None
    dropped_turns: int


@dataclass
class ChatHistory:
    """``encode(messages)`` renders the chat template into token ids; a prompt may have at
    most ``max_prompt_tokens`` tokens."""

    encode: Callable[[list[Message]], list[int]]
    max_prompt_tokens: int
    messages: list[Message] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def clear(self) -> None:
        self.messages.clear()

    def pop(self) -> Message:
        return self.messages.pop()

    def fit(self) -> FittedPrompt:
        """Drop the oldest turns (a user message and the replies up to the next user message)
        until the prompt fits; the newest turn is never dropped."""
        dropped = 0
        while True:
            ids = self.encode(self.messages)
            if len(ids) <= self.max_prompt_tokens:
                return FittedPrompt(ids, dropped)
            first = next((i for i, m in enumerate(self.messages) if m["role"] != "system"), None)
            following = None if first is None else next(
                (j for j in range(first + 1, len(self.messages))
                 if self.messages[j]["role"] == "user"), None)
            if following is None:  # only the newest turn is left
                return FittedPrompt(None, dropped)
            del self.messages[first:following]
            dropped += 1
