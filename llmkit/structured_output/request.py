"""A request's structured-output state: its spec's key, the compilation it waits for, then its
own grammar matcher (vLLM's ``StructuredOutputRequest``)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
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
