"""Structured output: grammars (JSON schema, json_object, regex, choice, EBNF) compiled off the step
path by a ``StructuredOutputManager`` in the engine core, and one token bitmask per step for
the sampler. Backends are picked by ``structured_output.name`` (``xgrammar``).
"""
from llmkit.registry import Registry
from llmkit.structured_output.base import (GrammarCompileError, StructuredOutputBackend,
                                           StructuredOutputGrammar, StructuredOutputKey,
                                           StructuredOutputKind, structured_output_key)

STRUCTURED_OUTPUT_BACKENDS: Registry = Registry("structured_output")
STRUCTURED_OUTPUT_BACKENDS.register_lazy(
    "xgrammar", "llmkit.structured_output.xgrammar_backend.XgrammarBackend")

__all__ = ["GrammarCompileError", "STRUCTURED_OUTPUT_BACKENDS", "StructuredOutputBackend",
           "StructuredOutputGrammar", "StructuredOutputKey", "StructuredOutputKind",
           "structured_output_key"]
