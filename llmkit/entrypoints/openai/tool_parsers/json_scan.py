"""Reading tool calls out of JSON text that may still be growing (a stream): where a value ends,
and an object's ``name`` and arguments as far as they go. What is returned for a prefix is a
prefix of what is returned for any longer text, so argument text can be streamed as deltas."""
from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["PartialCall", "read_call", "scan_value", "skip_ws"]

_WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    """``s[i]`` is ``"``: the index after the closing quote, or None if the string goes on."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return None


def scan_value(s: str, i: int) -> int | None:
    """The index just after the JSON value starting at ``s[i]``, or None if it is not complete
    yet (a number or literal is complete once a delimiter follows it)."""
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                j = _scan_string(s, i)
                if j is None:
                    return None
                i = j
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


@dataclass(slots=True)
class PartialCall:
    """A tool call read from ``{"name": ..., "arguments": ...}`` text, as far as it goes."""

    name: str | None = None
    arguments: str | None = None  # the arguments value's raw JSON text (a prefix if partial)
    end: int | None = None  # index after the object's ``}``; None while it is incomplete
    valid: bool = True  # False: the text is not such an object


def read_call(s: str, start: int = 0,
              argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall:
    """The object at ``s[start:]`` (after whitespace): its string ``name`` once complete, and
    the raw text of its first ``argument_keys`` member (grown as the text grows)."""
    call = PartialCall()
    i = skip_ws(s, start)
    if i >= len(s):
        return call
    if s[i] != "{":
        call.valid = False
        return call
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return call
        if s[i] == "}":
            call.end = i + 1
            return call
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            call.valid = False
            return call
        j = _scan_string(s, i)
        if j is None:
            return call
        key = json.loads(s[i:j])
        i = skip_ws(s, j)
        if i >= len(s):
            return call
        if s[i] != ":":
            call.valid = False
            return call
        i = skip_ws(s, i + 1)
        if i >= len(s):
            return call
        k = scan_value(s, i)
        if key == "name" and k is not None and s[i] == '"':
            call.name = json.loads(s[i:k])
        elif key in argument_keys and call.arguments is None:
            call.arguments = s[i:k] if k is not None else s[i:]
        if k is None:
            return call
        i = k
