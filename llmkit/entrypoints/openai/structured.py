"""An OpenAI request's output constraint as ``StructuredOutputsParams``: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` extra, or
the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` names.
At most one may be given; a spec that cannot become a grammar is a 400 naming the field."""
from __future__ import annotations

from llmkit.config.schema import EngineConfig
from llmkit.entrypoints.openai.errors import bad_request
from llmkit.entrypoints.openai.protocol import SamplingFields
from llmkit.sampling.params import StructuredOutputsParams
from llmkit.structured_output.validation import validate_structured_outputs

__all__ = ["checked_structured_outputs", "requested_structured_outputs"]


def requested_structured_outputs(req: SamplingFields
                                 ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint the request asks for, and the field it came from (None, None: none)."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                 "grammar": so.grammar, "json_object": so.json_object or None}
        found.append(("structured_outputs", {k: v for k, v in given.items() if v is not None}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise bad_request(f"give at most one output constraint; got {names}", found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None


def checked_structured_outputs(config: EngineConfig, params: StructuredOutputsParams,
                               field: str) -> StructuredOutputsParams:
    """``params`` if the engine's backend can build its grammar, else a 400 naming ``field``
    and what is wrong (an invalid schema, regex or grammar, an unsupported keyword)."""
    try:
        validate_structured_outputs(config, params)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None
    return params
