"""The front end's check of a structured-output spec, before the engine sees the request: the
configured backend turns it into a grammar without a tokenizer (milliseconds), so a bad
schema, regex or grammar is a ``ValueError`` (HTTP 400) at once, naming what is wrong."""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.sampling.params import StructuredOutputsParams
from llmkit.structured_output import STRUCTURED_OUTPUT_BACKENDS

__all__ = ["validate_structured_outputs"]


def validate_structured_outputs(config: EngineConfig, params: StructuredOutputsParams) -> None:
    """Raise ``GrammarCompileError`` (a ``ValueError``) if ``params`` cannot be served."""
    so = config.structured_output
    STRUCTURED_OUTPUT_BACKENDS.resolve(so.name, so.target).validate(params)
