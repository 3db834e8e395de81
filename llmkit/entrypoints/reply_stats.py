"""What ``llmkit generate`` and ``llmkit chat`` say about their replies: speed, tokens in and
out, and speculative decoding's acceptance.

Speculation is read from the engine's public counters (``llm.engine.stats().spec_decode``,
API.md), as the difference of two readings: the figures cover this command's replies only,
whatever ran on the engine before. Definitions (API.md's): acceptance rate = accepted draft
tokens / proposed draft tokens; mean acceptance length = 1 + accepted / drafts, the tokens a
request gains per verify step that had drafts (the +1 is the token the target samples itself).
A reply's speed counts its generated tokens over the time from submitting the prompt to its
last token, so the prompt's prefill is part of it (what a user waits for).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmkit.scheduler.base import SpecDecodeStats

__all__ = ["ReplyMeter", "spec_decode_line", "spec_decode_reading"]


def spec_decode_reading(llm: Any) -> SpecDecodeStats | None:
    """The engine's speculation counters now; ``None`` when speculation is off."""
    if not llm.config.speculative.enabled:
        return None
    return llm.engine.stats().spec_decode.snapshot()  # the engine keeps counting in its own


def spec_decode_line(counts: SpecDecodeStats, speculative: Any) -> str:
    """One line on the acceptance of ``counts`` (``speculative``: the engine's
    ``SpeculativeConfig``, named in the line)."""
    method = (f"{speculative.target or speculative.name}, "
              f"K={speculative.num_speculative_tokens}")
    if not counts.num_draft_tokens:
        # Said rather than left out: with no line at all, speculation looks switched off.
        hint = (" (n-gram lookup drafts only where the text repeats itself)"
                if speculative.name == "ngram" else "")
        return f"speculative decoding ({method}): no draft tokens proposed yet{hint}"
    return (f"speculative decoding ({method}): acceptance rate "
            f"{100 * counts.acceptance_rate:.1f}% ({counts.num_accepted_tokens} of "
            f"{counts.num_draft_tokens} draft tokens), mean acceptance length "
            f"{counts.mean_acceptance_length:.2f} tokens per verify step")


@dataclass(slots=True)
class ReplyMeter:
    """Counts a session's replies: the last one's and all of them together."""

    replies: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    last_output_tokens: int = 0
    last_seconds: float = 0.0

    def record(self, prompt_tokens: int, output_tokens: int, seconds: float) -> None:
        self.replies += 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.seconds += seconds
        self.last_output_tokens, self.last_seconds = output_tokens, seconds

    def lines(self) -> list[str]:
        if not self.replies:
            return ["no replies yet"]
        return [f"speed: last reply {_rate(self.last_output_tokens, self.last_seconds)} "
                f"({self.last_output_tokens} tokens in {self.last_seconds:.2f} s); overall "
                f"{_rate(self.output_tokens, self.seconds)} over {self.replies} "
                f"repl{'y' if self.replies == 1 else 'ies'}",
                f"tokens: {self.prompt_tokens} in (the prompts, conversation included), "
                f"{self.output_tokens} out"]


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"
