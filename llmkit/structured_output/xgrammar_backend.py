"""The xgrammar backend: JSON schema, ``json_object``, regex, choice and EBNF grammars compiled for
the model's tokenizer; matchers that advance, roll back and fill bitmasks, in batch.

xgrammar ignores several JSON-schema keywords without a word (``multipleOf``,
``uniqueItems``, unknown ``format`` values, ``not``, ...): an output could then break the
schema while the request looked constrained. ``unsupported_json_features`` finds them first,
so such a schema is refused with the keyword and its place instead.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import numpy as np
import xgrammar as xgr

from llmkit.sampling.params import StructuredOutputsParams
from llmkit.structured_output.base import (GrammarCompileError, StructuredOutputBackend,
                                           StructuredOutputGrammar, StructuredOutputKey,
                                           StructuredOutputKind, structured_output_key)

logger = logging.getLogger(__name__)

__all__ = ["XgrammarBackend", "XgrammarGrammar", "choice_as_ebnf", "unsupported_json_features"]

# String formats xgrammar turns into grammar (cpp/json_schema_converter.cc); others it ignores.
STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar enforces, and annotations that constrain nothing.
_ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "minItems", "maxItems", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format"})
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "nullable",
    "discriminator"})
# Keywords whose value maps names to schemas, and those whose value is a list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems",
                  "unevaluatedProperties", "unevaluatedItems")


def unsupported_json_features(schema: Any, path: str = "$") -> Iterator[str]:
    """Why xgrammar could not enforce ``schema``: one message per keyword, with its path."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        here = f"{path}.{key}"
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            if key == "uniqueItems" and value is False:
                continue
            yield f"'{key}' at {here}"
            continue
        if key == "format" and value not in STRING_FORMATS:
            yield f"'format': {value!r} at {here} (supported formats: " \
                  f"{', '.join(sorted(STRING_FORMATS))})"
        elif key == "$ref" and isinstance(value, str) and not (value == "#"
                                                               or value.startswith("#/")):
            yield f"'$ref' to {value!r} at {here} (only references inside the schema)"
        elif key == "allOf" and isinstance(value, list) and len(value) > 1:
            yield f"'allOf' with {len(value)} schemas at {here} (only one)"
        elif key == "pattern" and ("minLength" in schema or "maxLength" in schema):
            yield f"'pattern' with 'minLength'/'maxLength' at {path} (the lengths would be " \
                  "ignored; put them into the pattern)"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from unsupported_json_features(sub, f"{here}.{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from unsupported_json_features(sub, f"{here}[{i}]")
        elif key in _SCHEMA_VALUES:
            if isinstance(value, list):  # draft-4 tuple form of items
                for i, sub in enumerate(value):
                    yield from unsupported_json_features(sub, f"{here}[{i}]")
            else:
                yield from unsupported_json_features(value, here)


# xgrammar (0.2.x) writes the characters of a length-bounded JSON string (minLength /
# maxLength) as this class, which lets raw control characters into the string: invalid JSON.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def _json_strings_without_controls(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _LOOSE_STRING_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS))


def choice_as_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` with the choices escaped as EBNF string literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _load_schema(spec: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarCompileError(f"structured_outputs.json: not valid JSON ({e})") from None


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's message without its ``[time] /project/cpp/file.cc:123:`` prefix."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            return rest
    return text


class XgrammarGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher", "_stop_words", "_scratch", "_num_processed", "_terminated")

    def __init__(self, matcher: xgr.GrammarMatcher, stop_words: np.ndarray) -> None:
        self.matcher = matcher
        self._stop_words = stop_words  # bitmask row with the stop tokens' bits only
        self._scratch: np.ndarray | None = None
        self._num_processed = 0
        self._terminated = False

    @property
    def num_processed_tokens(self) -> int:
        return self._num_processed

    def accept_tokens(self, tokens: list[int]) -> bool:
        for tok in tokens:
            if self._terminated:
                return True
            if not self.matcher.accept_token(tok):
                return False
            self._num_processed += 1
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for tok in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                break
            accepted.append(tok)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.matcher.rollback(num_tokens)
        self._num_processed -= num_tokens
        self._terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def only_stop_tokens_allowed(self) -> bool:
        if self._terminated or not self.matcher.is_completed():
            return False
        if self._scratch is None:
            self._scratch = np.empty((1, len(self._stop_words)), dtype=np.int32)
        self.matcher.fill_next_token_bitmask(self._scratch, 0)
        return not bool((self._scratch[0] & ~self._stop_words).any())


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, *, tokenizer: Any, vocab_size: int, disable_any_whitespace: bool = False,
                 num_threads: int = 1) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size)
        self.any_whitespace = not disable_any_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                 vocab_size=vocab_size)
        # The compiler's own cache is off: the manager caches compiled grammars by key (and
        # shares one compilation among requests that arrive together).
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_threads,
                                            cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, num_threads))

    # -- front-end checks ---------------------------------------------------------------------
    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        kind, spec = structured_output_key(params)
        cls._grammar(kind, spec, any_whitespace=True)

    @staticmethod
    def _grammar(kind: StructuredOutputKind, spec: str, *, any_whitespace: bool) -> xgr.Grammar:
        """The spec as an xgrammar ``Grammar`` (no tokenizer needed: fast, for validation)."""
        if kind == StructuredOutputKind.JSON:
            schema = _load_schema(spec)
            if not isinstance(schema, (dict, bool)):
                raise GrammarCompileError("structured_outputs.json: a JSON schema is an object, "
                                          f"got {type(schema).__name__}")
            problems = list(unsupported_json_features(schema))
            if problems:
                raise GrammarCompileError(
                    "structured_outputs.json: unsupported JSON-schema feature "
                    f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                        else "") + "; xgrammar cannot enforce it")
            return _converted("json", lambda: _json_strings_without_controls(
                xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)))
        if kind == StructuredOutputKind.JSON_OBJECT:
            return _converted("json_object", lambda: xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace))
        if kind == StructuredOutputKind.REGEX:
            if "\x00" in spec:
                raise GrammarCompileError("structured_outputs.regex: must not contain a NUL "
                                          "character")
            return _converted("regex", lambda: xgr.Grammar.from_regex(spec))
        if kind == StructuredOutputKind.CHOICE:
            return _converted("choice", lambda: xgr.Grammar.from_ebnf(
                choice_as_ebnf(json.loads(spec))))
        return _converted("grammar", lambda: xgr.Grammar.from_ebnf(spec))

    # -- engine side ----------------------------------------------------------------------------
    def compile(self, key: StructuredOutputKey) -> xgr.CompiledGrammar:
        kind, spec = key
        grammar = self._grammar(kind, spec, any_whitespace=self.any_whitespace)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise GrammarCompileError(f"structured_outputs.{kind.value}: cannot compile: "
                                      f"{_xgrammar_message(e)}") from None

    def new_grammar(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int],
                    max_rollback_tokens: int = 0) -> XgrammarGrammar:
        stops = sorted({t for t in stop_token_ids if 0 <= t < self.vocab_size})
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                     max_rollback_tokens=max_rollback_tokens)
        return XgrammarGrammar(matcher, self._stop_words(tuple(matcher.stop_token_ids)))

    def _stop_words(self, stops: tuple[int, ...]) -> np.ndarray:
        words = np.zeros(self.allocate_bitmask(1).shape[1], dtype=np.uint32)
        for t in stops:
            words[t // 32] |= np.uint32(1 << (t % 32))
        return words.view(np.int32)

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray,
                      rows: list[int]) -> None:
        matchers = [g.matcher for g in grammars]  # type: ignore[attr-defined]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def shutdown(self) -> None:
        self.compiler.clear_cache()


def _converted(kind: str, make) -> xgr.Grammar:
    try:
        return make()
    except GrammarCompileError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
        raise GrammarCompileError(f"structured_outputs.{kind}: {_xgrammar_message(e)}") from None
