"""Starting a worker process from any kind of user program, and keeping what it said.

Workers are spawned, never forked: by the time an executor starts them the parent has run torch
ops, so its OpenMP pool and gloo threads exist, and a forked child inherits their locks held.
Spawn has its own trap: before running the target, the child imports the parent's
``__main__`` (as ``__mp_main__``) so that objects defined there unpickle. A script without an
``if __name__ == "__main__":`` guard therefore builds its ``LLM`` again inside every worker
(which multiprocessing refuses during bootstrap), and code fed on standard input has no file to
import (``<stdin>``): either way the worker died with exit code 1 and no reason.

So :func:`start_process` hides ``__main__`` from the child (as concurrent.futures' workers and
Ray's do by not re-running it) unless the main file is a script with a top-level guard -- there
the child imports it as before, so classes the user defined in it stay available.
A worker target never needs ``__main__``: it is a function of ``llmkit.executor`` and its
arguments are plain data.

Every worker's stderr also passes through a pipe that the parent copies to its own stderr and
keeps the last lines of (:class:`StderrTail`), so that a ``WorkerDiedError`` can say what the
worker printed before it died -- including errors raised before the target ran.
"""
from __future__ import annotations

import ast
import contextlib
import os
import sys
import threading
import types
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["StderrTail", "hide_main_if_needed", "main_needs_hiding", "start_process"]

#: Lines of a worker's stderr kept for its error message.
TAIL_LINES = 20


class StderrTail:
    """Reads a child's stderr pipe on a daemon thread: every chunk goes on to this process's
    stderr at once (the worker's logs stay visible), the last ``TAIL_LINES`` lines stay here."""

    def __init__(self, read_fd: int, name: str, forward_fd: int = 2) -> None:
        self._fd = read_fd
        self._forward_fd = forward_fd
        self._lines: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name=f"{name}-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            # a read error ends the pump like the end of the pipe: the child is gone
            with contextlib.suppress(OSError):
                while chunk := os.read(self._fd, 65536):
                    with contextlib.suppress(OSError):
                        os.write(self._forward_fd, chunk)
                    with self._lock:
                        *complete, self._partial = (self._partial + chunk).split(b"\n")
                        self._lines.extend(line.decode("utf-8", "replace")
                                           for line in complete)
        finally:
            os.close(self._fd)

    def text(self, wait_s: float = 1.0) -> str:
        """The last lines, once the pipe has closed (the child ended) or after ``wait_s``."""
        self._thread.join(timeout=wait_s)
        with self._lock:
            lines = [*self._lines] + ([self._partial.decode("utf-8", "replace")]
                                      if self._partial else [])
        return "\n".join(line.rstrip() for line in lines if line.strip())[-4000:]


def _main_file() -> Path | None:
    """The file spawn's children would import as ``__mp_main__`` (None: none)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(spec, "origin", None) if spec is not None else getattr(main, "__file__", None)
    return Path(path) if path else None


def _has_main_guard(source: str) -> bool:
    """A top-level ``if __name__ == "__main__":`` (either operand order)."""
    for node in ast.parse(source).body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and [type(op) for op in node.test.ops] == [ast.Eq]):
            operands = [node.test.left, *node.test.comparators]
            names = {o.id for o in operands if isinstance(o, ast.Name)}
            values = {o.value for o in operands if isinstance(o, ast.Constant)}
            if "__name__" in names and "__main__" in values:
                return True
    return False


def main_needs_hiding() -> bool:
    """Whether a spawned child must not import this process's ``__main__``: it has a file
    that cannot be read back (``<stdin>``) or a script without a guard, which would run again."""
    path = _main_file()
    if path is None:  # python -c, a notebook, the REPL: spawn imports nothing anyway
        return False
    try:
        return not _has_main_guard(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return True


@contextlib.contextmanager
def _hidden_main() -> Iterator[None]:
    """While a spawn child's preparation data is taken (inside ``Process.start``), ``__main__``
    is a bare module: no name, no file, so the child imports nothing of it."""
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def hide_main_if_needed() -> contextlib.AbstractContextManager:
    """Around a spawn ``Process.start()``: ``__main__`` hidden when :func:`main_needs_hiding`
    (the engine core's process starts this way too)."""
    return _hidden_main() if main_needs_hiding() else contextlib.nullcontext()


def _flush_stderr() -> None:
    if sys.stderr is not None:  # None under pythonw and in some embedded interpreters
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()


@contextlib.contextmanager
def _stderr_to(fd: int) -> Iterator[None]:
    """This process's fd 2 is ``fd`` while a child is started, so the child inherits it as its
    stderr from its first instruction (spawn passes no other way to redirect it)."""
    _flush_stderr()  # what this process wrote before stays its own
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        _flush_stderr()
        os.dup2(saved, 2)
        os.close(saved)


def start_process(ctx: Any, target: Callable, args: tuple, name: str
                  ) -> tuple[Any, StderrTail]:
    """Start ``target(*args)`` in a daemon process of the multiprocessing context ``ctx``
    (spawn), with ``__main__`` hidden where importing it would fail, and its stderr teed."""
    proc = ctx.Process(target=target, args=args, name=name, daemon=True)
    if os.name == "posix":  # started now, it would inherit the pipe and hold it open for good
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    read_fd, write_fd = os.pipe()
    try:
        with _stderr_to(write_fd), hide_main_if_needed():
            proc.start()
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child holds its copy: EOF comes when it ends
    return proc, StderrTail(read_fd, name)
