"""Bad words: token sequences the output must never contain (vLLM's ``bad_words``).

The front end tokenizes each word twice — as at the start of the text and after a space —
since byte-level and SentencePiece vocabularies spell the two differently. At each step the
runner bans a word's last token when the output already ends with the word's other tokens
(single-token words are always banned). Like vLLM, this matches these canonical tokenizations
of the output tokens only; an unusual spelling of the word by other tokens is not caught.
"""
from __future__ import annotations

from typing import Protocol, Sequence


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def tokenize_bad_words(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """Token id sequences for ``words``, with and without a leading space, deduplicated."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            key = tuple(ids)
            if ids and key not in seen:
                seen.add(key)
                out.append(list(ids))
    return out


def banned_next_tokens(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Tokens that would complete a bad word after ``output`` (the tokens generated so far)."""
    banned = []
    n = len(output)
    for word in bad_words:
        k = len(word) - 1
        if k == 0 or (k <= n and list(output[n - k:]) == list(word[:k])):
            banned.append(word[-1])
    return banned
