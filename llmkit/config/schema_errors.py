"""Pydantic validation errors against a composed config (its root's schema: ``EngineConfig``
for the engine's root, the tools' document for theirs) as one-line ``ConfigError``s: the
dotted key the user typed, the value, and what the schema allows, in plain words ("an integer
>= 1", "one of: fcfs, priority", "a key of scheduler: ...").

Composition (``llmkit.config.compose``) validates through ``validate_document``; Hydra's
own errors reuse ``known_keys_text`` and ``value_at`` (``llmkit.config.hydra_errors``).
"""
from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig

__all__ = ["known_keys_text", "model_at", "validate_document",
           "validation_error_to_config_error", "value_at"]

M = TypeVar("M", bound=BaseModel)


def _fields_by_alias(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def _strip_optional(ann: Any) -> Any:
    args = typing.get_args(ann)
    if _is_union(ann) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return ann


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


_NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a string", "strings"), bool: ("true or false", "booleans")}


def _describe(ann: Any, metadata: Sequence[Any] = ()) -> str:
    """Plain words for what a field accepts: 'an integer >= 1', 'one of: fcfs, priority'."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _describe(args[0], list(metadata) + list(ann.__metadata__))
    if _is_union(ann):
        parts = [_describe(a, metadata) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or null" if type(None) in args else text
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (list, tuple, set, Sequence):
        if args and args[0] in _NOUNS:
            return f"a list of {_NOUNS[args[0]][1]}"
        if args:
            return f"a list of ({_describe(args[0])})"
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a mapping with keys: " + ", ".join(_fields_by_alias(ann))
    text = _NOUNS.get(ann, (getattr(ann, "__name__", str(ann)), ""))[0]
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{op} {v}")
    return text + (" " + " and ".join(bounds) if bounds else "")


def _walk_loc(loc: Sequence[Any], root: type[BaseModel]
              ) -> tuple[str, Any | None, type[BaseModel] | None, Any]:
    """(dotted key, FieldInfo of the last field reached or None, the model the key names
    (None unless the key is a section), the annotation of what the key names), from the
    document's model ``root``."""
    key = ""
    model: type[BaseModel] | None = root
    ann: Any = None
    field = None
    for part in loc:
        if isinstance(part, int):
            if ann is not None and typing.get_origin(_strip_optional(ann)) in (list, tuple):
                key += f"[{part}]"
                item_args = typing.get_args(_strip_optional(ann))
                ann = item_args[0] if item_args else Any
                field = None
                continue
            break
        if model is None:
            break
        fields = _fields_by_alias(model)
        if part not in fields:
            # an unknown key (extra_forbidden) or a union member tag: name it only if it is the
            # key the user typed, i.e. the parent is a model
            if not _looks_like_tag(part):
                key = f"{key}.{part}" if key else str(part)
                field = None
                model = None
            break
        field = fields[part]
        key = f"{key}.{part}" if key else part
        ann = field.annotation
        inner = _strip_optional(ann)
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    return key, field, model, ann


def _looks_like_tag(part: Any) -> bool:
    # pydantic names union members in loc: 'str', 'list[int]', 'function-after[...]'
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"}
                                      or "[" in part or part.startswith(("function-", "lax-")))


def validation_error_to_config_error(err: ValidationError, data: Any = None,
                                     root: type[BaseModel] = EngineConfig) -> ConfigError:
    """The first error of a pydantic ValidationError as one ConfigError line (keys named from
    the document's model ``root``)."""
    e = err.errors(include_url=False)[0]
    loc, etype, value = e["loc"], e["type"], e.get("input")
    key, field, model, ann = _walk_loc(loc, root)
    msg = e["msg"]
    if etype == "extra_forbidden":
        parent = key.rpartition(".")[0]
        where = parent or "the config"
        holder = model_at(parent, root)
        keys = ", ".join(_fields_by_alias(holder)) if holder else ""
        return ConfigError(key, value, f"a key of {where}: {keys}" if keys else "a known key")
    if etype == "missing":
        allowed = _describe(field.annotation, field.metadata) if field is not None else "a value"
        return ConfigError(key, ConfigError.MISSING, allowed)
    if etype in ("value_error", "assertion_error"):
        text = re.sub(r"^(Value|Assertion) error,\s*", "", msg)
        if model is not None or not key:
            # a model-level check: name the first dotted key its message mentions
            m = re.search(r"\b([a-z_]+\.[a-z_]+)\b", text)
            if m:
                k = m.group(1)
                return ConfigError(k, value_at(data, k, value), text)
            return ConfigError(key or "config", None, "", message=text)
        text = re.sub(r",\s*got .*$", "", text)
        text = re.sub(r"^must be\s+", "", text)
        return ConfigError(key, value, text)
    if field is not None:
        return ConfigError(key, value, _describe(field.annotation, field.metadata))
    if model is not None:
        return ConfigError(key, value, _describe(model))
    if ann is not None and ann is not Any:
        return ConfigError(key, value, _describe(ann))
    return ConfigError(key or "config", value, msg)


def model_at(dotted: str, root: type[BaseModel] = EngineConfig) -> type[BaseModel] | None:
    """The config section (a pydantic model) that ``dotted`` names in the document ``root``;
    None for a plain field or an unknown key."""
    if not dotted:
        return root
    key, _, model, _ = _walk_loc(dotted.split("."), root)
    return model if key == dotted else None


def value_at(data: Any, dotted: str, default: Any) -> Any:
    """``data[a][b]`` for ``dotted`` = ``"a.b"``, or ``default`` where the path stops."""
    cur = data
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def validate_document(data: dict, schema: type[M]) -> M:
    """A whole composed document from plain data, as its root's ``schema``; the first error as
    a ``ConfigError``."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_config_error(e, data, schema) from None


def known_keys_text(dotted: str, root: type[BaseModel] = EngineConfig) -> str:
    """'a key of scheduler: name, _target_, ...' for the section that holds ``dotted`` in the
    document ``root``."""
    parts = dotted.split(".")
    model: type[BaseModel] = root
    where = "the config"
    for part in parts[:-1]:
        fields = _fields_by_alias(model)
        if part not in fields:
            break
        ann = _strip_optional(fields[part].annotation)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model, where = ann, (part if where == "the config" else f"{where}.{part}")
    return f"a key of {where}: {', '.join(_fields_by_alias(model))}"

