"""Hydra's side of composition errors: override text that does not parse, and Hydra or
OmegaConf failures (unknown group option, unknown key, '+' on an existing key, ...) as one-line
``ConfigError``s naming the dotted key, the value and what is allowed."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.config.schema_errors import known_keys_text, value_at

__all__ = ["OVERRIDE_SYNTAX", "first_line", "hydra_error_to_config_error", "parse_override"]

OVERRIDE_SYNTAX = ("key=value (Hydra override syntax; +key=value adds a key, ~key deletes one; "
                   "quote values with special characters: key='a,b')")


def parse_override(text: str) -> Any:
    """Hydra's parsed ``Override``; a syntax error as a ``ConfigError`` naming the key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(text)
    except HydraException:
        key, sep, value = text.partition("=")
        if not sep:
            raise ConfigError(text, None, OVERRIDE_SYNTAX,
                              message=f"not an override: {text!r}; expected {OVERRIDE_SYNTAX}"
                              ) from None
        raise ConfigError(key.lstrip("+~"), value, OVERRIDE_SYNTAX) from None


def first_line(text: str) -> str:
    # Hydra's messages can span several lines; a ConfigError is one line.
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return str(text).strip()


def hydra_error_to_config_error(e: Exception, overrides: Sequence[str],
                                options_of: Callable[[str], list[str]],
                                schema: type[BaseModel] = EngineConfig) -> ConfigError:
    """A Hydra/OmegaConf failure as one ConfigError line. ``options_of(group)`` lists a
    group's options where Hydra's error does not; ``schema``: the composed document's model,
    whose keys an unknown key's message lists."""
    from hydra.errors import MissingConfigException

    msg = str(e)
    values: dict[str, Any] = {}
    for o in overrides:
        try:
            ov = parse_override(o)
            values[ov.key_or_group] = (o.partition("=")[2] if ov.is_sweep_override()
                                       else ov.value())
        except Exception:  # noqa: BLE001 - best effort: the raw text
            k, _, v = o.partition("=")
            values[k.lstrip("+~")] = v

    if isinstance(e, MissingConfigException):
        m = re.search(r"Could not find '([^']+)'", msg)
        if m and "/" in m.group(1):
            group, _, option = m.group(1).rpartition("/")
            group = group.lstrip("/")
            options = list(e.options or []) or options_of(group)
            return ConfigError(group, option, ", ".join(options))
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        value = values.get(key)
        full_key = getattr(e.__cause__, "full_key", None)
        if isinstance(full_key, str) and full_key.startswith(key + "."):
            value = value_at(value, full_key[len(key) + 1:], value)
            key = full_key
        return ConfigError(key, value, known_keys_text(key, schema))
    m = re.search(r"Could not append to config. An item is already at '([^']+)'", msg)
    if m:
        key = m.group(1)
        return ConfigError(key, values.get(key), f"{key}=... (the key exists; '+' only adds "
                           "new keys, '++' adds or overrides)")
    m = re.search(r"Could not delete from config\. '([^']+)' does not exist", msg)
    if m:
        key = m.group(1)
        return ConfigError(key, None, "", message="cannot delete: the key does not exist")
    full_key = getattr(e, "full_key", None)
    m = re.search(r"'([A-Za-z_][\w.\-/]*)'", msg)
    key = full_key or (m.group(1) if m else "config")
    return ConfigError(key, values.get(key), "", message=first_line(msg))
