"""The structured-output interface: what a grammar backend compiles, and the per-request grammar
(a matcher) the manager drives through a request's life.

Bitmask layout (xgrammar's, the seam with the sampler): int32 ``[rows, ceil(V / 32)]``, bit
``i`` of word ``j`` allows token ``32 * j + i``; a row of ``-1`` allows everything.
"""
from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from llmkit.sampling.params import StructuredOutputsParams

__all__ = ["GrammarCompileError", "StructuredOutputBackend", "StructuredOutputGrammar",
           "StructuredOutputKey", "StructuredOutputKind", "bitmask_words", "structured_output_key"]


class StructuredOutputKind(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


# (kind, spec as text): what a grammar is compiled from, and its cache key.
StructuredOutputKey = tuple[StructuredOutputKind, str]


class GrammarCompileError(ValueError):
    """A spec that cannot become a grammar; the message says what is wrong (a 400 on the
    server)."""


def structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    """The key of a request's spec. JSON keeps its key order: a schema's property order is
    the order the output writes them in, so two orders are two grammars."""
    if params.json is not None:
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputKind.JSON, spec
    if params.json_object:
        return StructuredOutputKind.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputKind.REGEX, params.regex
    if params.choice is not None:
        return StructuredOutputKind.CHOICE, json.dumps(params.choice)
    assert params.grammar is not None  # StructuredOutputsParams checks exactly one is set
    return StructuredOutputKind.GRAMMAR, params.grammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputGrammar(ABC):
    """One request's position in its grammar (a matcher over a compiled grammar)."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (and no advance past it) at the first token the
        grammar does not allow. Tokens after termination are ignored."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts from here (state unchanged)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected draft tokens)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """A stop token was accepted: the grammar constrains nothing any more."""

    @abstractmethod
    def only_stop_tokens_allowed(self) -> bool:
        """The output is complete and nothing but a stop token may follow."""

    @property
    @abstractmethod
    def num_processed_tokens(self) -> int:
        """Tokens accepted so far (after rollbacks)."""


class StructuredOutputBackend(ABC):
    """Compiles specs into grammars for one tokenizer and vocabulary; fills batch bitmasks.

    ``compile`` runs in the manager's thread pool (it must be thread-safe); everything else runs
    on the engine's thread. ``validate`` is a class method: the front end calls it before a
    request reaches the engine, without a tokenizer, so bad input is a 400 at once.
    """

    def __init__(self, *, tokenizer: Any, vocab_size: int, disable_any_whitespace: bool = False,
                 num_threads: int = 1) -> None:
        self.vocab_size = vocab_size

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``GrammarCompileError`` naming what is wrong with ``params``."""

    @abstractmethod
    def compile(self, key: StructuredOutputKey) -> Any:
        """A compiled grammar (shared by every request with this key); raises
        ``GrammarCompileError``."""

    @abstractmethod
    def new_grammar(self, compiled: Any, stop_token_ids: list[int],
                    max_rollback_tokens: int = 0) -> StructuredOutputGrammar:
        """A fresh matcher at the start of ``compiled``; ``stop_token_ids`` end the output."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray,
                      rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``grammars[i]`` (a backend may do it in parallel)."""
        for g, r in zip(grammars, rows):
            g.fill_bitmask(bitmask, r)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        return np.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=np.int32)

    def shutdown(self) -> None:
        """Free what the backend holds (compiler caches, threads)."""

