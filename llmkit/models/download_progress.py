"""One progress line for a download that llmkit runs (the default model's first fetch).

On a terminal the line is rewritten in place (bytes so far, rate); elsewhere (a log, a pipe)
nothing is rewritten: the line says what is being fetched when it starts and how much, how
fast, when it ends, so a log holds two clean lines instead of a progress bar's redraws.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

__all__ = ["DownloadProgress", "format_bytes"]


def format_bytes(n: float) -> str:
    """Decimal units, as download tools show them (``85.1 MB``)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class DownloadProgress:
    """``update(nbytes)`` while downloading, then ``finish(nbytes)`` or ``abandon()``."""

    def __init__(self, label: str, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 done_label: str | None = None) -> None:
        self.label = label
        # the closing line's start (default "<label>: done"): shorter than a long label
        self.done_label = done_label or f"{label}: done"
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        isatty = getattr(self.stream, "isatty", None)
        self.in_place = bool(isatty and isatty())
        self._width = 0
        if not self.in_place:
            self._write(f"{label} ...\n")
        else:
            self.update(0)

    def _status(self, nbytes: int) -> str:
        elapsed = self.clock() - self.start
        rate = f", {format_bytes(nbytes / elapsed)}/s" if elapsed > 0 and nbytes else ""
        return f"{format_bytes(nbytes)}{rate}"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def update(self, nbytes: int) -> None:
        if not self.in_place:
            return
        line = f"{self.label}: {self._status(nbytes)}"
        # pad over the previous, longer text; no ANSI codes (a plain \r works everywhere)
        self._write("\r" + line.ljust(self._width))
        self._width = len(line)

    def abandon(self) -> None:
        """End an in-place line without a result (the download failed), so that the error
        that follows starts on a line of its own."""
        if self.in_place and self._width:
            self._write("\n")
            self._width = 0

    def finish(self, nbytes: int) -> None:
        elapsed = self.clock() - self.start
        done = f"{format_bytes(nbytes)} in {elapsed:.1f} s"
        if elapsed > 0:
            done += f" ({format_bytes(nbytes / elapsed)}/s)"
        line = f"{self.done_label}, {done}"
        self._write(("\r" + line.ljust(self._width) if self.in_place else line) + "\n")
