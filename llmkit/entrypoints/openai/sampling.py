"""An OpenAI request's sampling fields as ``SamplingParams``, by their (vLLM = OpenAI) names, and
its output constraint as ``StructuredOutputsParams`` (``SamplingParams.structured_outputs``).

A field set to a non-neutral value that this build's ``SamplingParams`` lacks is refused with a
400 naming it, never silently ignored.

Fields the request leaves unset take the model's recommended defaults (``defaults``: vLLM's
generation config, ``llmkit.models.generation_config``) before ``SamplingParams``' own; the
model's ``max_tokens`` caps the request's, as in vLLM.

The constraint: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` extra, or the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` names. At most one may be given; a spec that cannot
become a grammar is a 400 naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from llmkit.config.schema import EngineConfig
from llmkit.entrypoints.openai.errors import bad_request, param_of
from llmkit.entrypoints.openai.protocol import SamplingFields
from llmkit.sampling.params import SamplingParams, StructuredOutputsParams
from llmkit.structured_output.validation import validate_structured_outputs

__all__ = ["check_token_ids", "checked_structured_outputs", "requested_structured_outputs",
           "to_sampling_params"]

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Values that ask for nothing: a field that SamplingParams lacks may still be sent with these.
_NEUTRAL: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "repetition_penalty": 1.0, "include_stop_str_in_output": False,
                            "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
                            "spaces_between_special_tokens": True}


def check_token_ids(ids: list[int], param: str, vocab_size: int) -> None:
    """A 400 naming ``param`` for the first id outside the vocabulary."""
    for t in ids:
        if t >= vocab_size:
            raise bad_request(f"token id {t} is out of range (the vocabulary has "
                              f"{vocab_size} tokens)", param)


def to_sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                       vocab_size: int,
                       defaults: Mapping[str, Any] | None = None,
                       structured_outputs: StructuredOutputsParams | None = None
                       ) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; a 400 for ids outside the
    vocabulary, for a field this build lacks, or for a value ``SamplingParams`` refuses.
    ``defaults``: the model's values for fields the request leaves unset (``None``)."""
    defaults = dict(defaults or {})
    model_max = defaults.pop("max_tokens", None)
    if model_max is not None:
        max_tokens = model_max if max_tokens is None else min(max_tokens, model_max)
    stop = req.stop
    wanted: dict[str, Any] = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "seed": req.seed, "max_tokens": max_tokens,
        "min_tokens": req.min_tokens, "stop": [stop] if isinstance(stop, str) else stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": ({int(k): v for k, v in req.logit_bias.items()}
                       if req.logit_bias else None),
        "logprobs": logprobs, "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "bad_words": req.bad_words, "allowed_token_ids": req.allowed_token_ids,
        "structured_outputs": structured_outputs,
    }
    for name, value in defaults.items():
        if wanted.get(name) is None:
            wanted[name] = value
    for name, ids in (("logit_bias", list(wanted["logit_bias"] or ())),
                      ("stop_token_ids", req.stop_token_ids or []),
                      ("allowed_token_ids", req.allowed_token_ids or [])):
        check_token_ids(ids, name, vocab_size)
    kwargs: dict[str, Any] = {}
    for name, value in wanted.items():
        neutral = value is None or value == [] or (name in _NEUTRAL
                                                   and value == _NEUTRAL[name])
        if name not in _PARAM_FIELDS:
            if not neutral:
                raise bad_request(f"`{name}` is not supported by this server yet", name)
            continue
        if value is not None or name == "max_tokens":
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param_of(str(e))) from None


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
