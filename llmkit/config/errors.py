"""ConfigError: one readable line naming the dotted key, the value given and what is allowed."""
from __future__ import annotations

from typing import Any


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


class ConfigError(ValueError):
    """A configuration value that cannot be used.

    ``str(err)`` is one line: ``scheduler.max_num_seqs: got 'abc'; allowed: an integer >= 1``.
    ``message`` (optional) replaces the ``got ...; allowed: ...`` part for errors that are not
    about a single value.
    """

    #: Pass as ``value`` when the key was not given at all.
    MISSING: Any = _Missing()

    def __init__(self, key: str, value: Any, allowed: str, *, message: str | None = None) -> None:
        self.key = key
        self.value = value
        self.allowed = _one_line(allowed)
        self.message = _one_line(message) if message is not None else None
        super().__init__(str(self))

    def __str__(self) -> str:
        key = self.key or "config"
        if self.message is not None:
            return f"{key}: {self.message}"
        return f"{key}: got {format_value(self.value)}; allowed: {self.allowed}"

    def __reduce__(self):  # keep pickling (multiprocessing) working with keyword-only args
        return (_rebuild, (self.key, self.value, self.allowed, self.message))


def _rebuild(key: str, value: Any, allowed: str, message: str | None) -> ConfigError:
    return ConfigError(key, value, allowed, message=message)


def format_value(value: Any) -> str:
    """How a value is shown in an error: strings quoted, YAML spelling for null and booleans."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    return _one_line(text)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
