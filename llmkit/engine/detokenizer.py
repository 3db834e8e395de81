"""Incremental detokenization: text deltas as tokens arrive, never a broken UTF-8 piece.

Uses the `tokenizers` library's DecodeStream, which holds back bytes until they form whole
characters (byte-level BPE splits multi-byte characters across tokens). The stream is primed
with the prompt's last tokens so that the first output token decodes with its context (leading
spaces of SentencePiece-style vocabularies).
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

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        pieces = []
        for tok in token_ids:
            piece = self._stream.step(self._backend, tok)
            if piece:
                pieces.append(piece)
        delta = "".join(pieces)
        self.text += delta
        return delta
