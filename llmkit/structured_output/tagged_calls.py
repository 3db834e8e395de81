"""A grammar for tool calls written as tagged JSON blocks (``<tool_call>\\n{...}\\n</tool_call>``,
one or more, separated by a newline), as EBNF text for ``StructuredOutputsParams(grammar=...)``.

Why blocks and not vLLM's JSON array (``[{...}, ...]``): after a complete call an array lets
the model only write ``,`` or ``]``, and a small model that has listed one call keeps listing
(SmolLM2-135M wrote ``},{`` until ``max_tokens``: issue 31). After a block the grammar accepts
the end of the output (the stop token) or the next block; models trained on the Hermes format,
and the tool prompt llmkit writes, end there. The JSON inside a block follows the call's schema,
so every complete call parses and validates.

xgrammar's structural tags build it (one ``tag``, or ``tags_with_separator`` with at least one
call); the EBNF it prints is what is returned, so any backend that reads EBNF can enforce it.
"""
from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from llmkit.structured_output.xgrammar_backend import (_JSON_STRING_CHARS, _LOOSE_STRING_CHARS,
                                                       unsupported_json_features)

__all__ = ["CALL_BEGIN", "CALL_END", "CALL_SEPARATOR", "tagged_calls_grammar"]

CALL_BEGIN, CALL_END, CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"


def tagged_calls_grammar(call_schema: dict[str, Any], *, parallel: bool,
                         any_whitespace: bool = True) -> str:
    """EBNF for one call (``parallel=False``) or one or more calls, each block's JSON following
    ``call_schema``; the output may end after any complete block. ``any_whitespace=False``
    (``structured_output.disable_any_whitespace``) writes the JSON on one line, as the tool
    prompt shows it. A ``ValueError`` says which part of the schema cannot be enforced."""
    problems = list(unsupported_json_features(call_schema))
    if problems:
        raise ValueError(f"unsupported JSON-schema feature {problems[0]}"
                         + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    try:
        # The JSON as a grammar of its own: a structural tag's json_schema content ignores
        # any_whitespace, and free whitespace lets a weak model pad a call until max_tokens.
        body = xgr.Grammar.from_json_schema(json.dumps(call_schema),
                                            any_whitespace=any_whitespace)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad schema
        raise ValueError(f"cannot build the tool-call grammar: {e}") from None
    tag = {"type": "tag", "begin": CALL_BEGIN, "end": CALL_END,
           "content": {"type": "grammar", "grammar": str(body)}}
    fmt = tag if not parallel else {"type": "tags_with_separator", "tags": [tag],
                                    "separator": CALL_SEPARATOR, "at_least_one": True,
                                    "stop_after_first": False}
    try:
        grammar = xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt}))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad schema
        raise ValueError(f"cannot build the tool-call grammar: {e}") from None
    # The same repair as for JSON schemas: length-bounded strings must not admit raw controls.
    return str(grammar).replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS)
