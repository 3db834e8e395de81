"""Incremental detokenization: text deltas as tokens arrive, never a broken UTF-8 piece.

Uses the `tokenizers` library's DecodeStream, which holds back bytes until they form whole
characters (byte-level BPE splits multi-byte characters across tokens). The stream is primed
with the prompt's last tokens so that the first output token decodes with its context (leading
spaces of SentencePiece-style vocabularies).

``spaces_between_special_tokens`` only affects slow (Python) tokenizers; fast ones, the only
kind llmkit detokenizes with, ignore it, as they do in vLLM and transformers.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; llmkit needs "
                            "a `tokenizers`-backed one for incremental detokenization")
        self._backend = backend
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PRIME_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        return "".join([self.add_token(t) for t in token_ids])


class TokenTexts:
    """Each token's own text (``Logprob.decoded_token``), decoded once per token id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text
