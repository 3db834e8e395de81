"""Stop strings, matched on the detokenized text as it grows (so across token boundaries)."""
from __future__ import annotations

from typing import Sequence


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that the last ``num_new_chars`` characters of ``text`` complete, and
    the length to cut ``text`` to (before the string, or after it if ``include_in_output``).

    Only occurrences that overlap the new characters are searched (older text was searched
    before). When several match, the one that starts first wins: the text never contains a
    stop string before its cut.
    """
    if not num_new_chars or not stop:
        return None
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + len(s) if include_in_output else i


def holdback_chars(stop: Sequence[str], include_in_output: bool) -> int:
    """Characters a stream holds back: a stop string may be starting in them, and text once
    streamed cannot be taken back (vLLM's ``stop_buffer_length``)."""
    if not stop or include_in_output:
        return 0
    return max(len(s) for s in stop) - 1
