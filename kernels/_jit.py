"""How llmkit's Triton kernels are compiled, launched and counted.

``@jit`` replaces ``@triton.jit`` for every kernel of ``llmkit.kernels``. Triton decides between
its compiler and its CPU interpreter when a function is *decorated*, from ``TRITON_INTERPRET``;
this wrapper decides at *launch* instead, reading ``TRITON_INTERPRET`` each time. So the mode
does not depend on which module imported Triton (or this package) first: a test may set
``TRITON_INTERPRET=1`` with ``monkeypatch.setenv`` in the same pytest process, and a server on a
GPU never pays for the interpreter. Triton's own library functions (``tl.sum``, ``tl.max``), which
*are* fixed at the import of ``triton.language``, are run through the interpreter for the
duration of an interpreted launch (:func:`_library_calls_interpreted`).

Every launch is counted per kernel name (``launch_counts``, ``count_launches()``): tests assert
that a code path really ran the Triton kernels they meant to test. ``record_launches`` records
launches (optionally without running them) for ahead-of-time compilation (``aot``).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator

import torch

#: Launches per kernel name since the process started (or since the counter was cleared).
launch_counts: collections.Counter[str] = collections.Counter()

_TRUE = ("1", "true", "yes", "on", "y")  # triton.knobs' env_bool


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET`` is set to a true value now (read on every call, as Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_importable() -> str | None:
    """``None`` when Triton can be imported, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the installation
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why Triton kernels cannot run on ``device`` now, or ``None`` when they can: on a CUDA
    device they compile; on any other device only Triton's interpreter runs them."""
    why = triton_importable()
    if why:
        return why
    device = torch.device(device)
    if device.type == "cuda" or interpreter_enabled():
        return None
    return (f"Triton kernels need a CUDA GPU; on {device.type!r} they run only under Triton's "
            "interpreter (set TRITON_INTERPRET=1 -- slow, meant for tests)")


class KernelLaunchError(RuntimeError):
    """A kernel launched where it cannot run (e.g. CPU tensors without TRITON_INTERPRET)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch as the launcher made it: the kernel, its grid and its arguments."""

    kernel: "Kernel"
    grid: Any
    args: tuple
    kwargs: dict


class _Recorder(list):
    def __init__(self, execute: bool) -> None:
        super().__init__()
        self.execute = execute


_recorders: list[_Recorder] = []


@contextlib.contextmanager
def record_launches(execute: bool = True) -> Iterator[list[Launch]]:
    """``with record_launches(execute=False) as launches: rms_norm(x, w, eps)``: the launches
    made inside the block, in order; with ``execute=False`` nothing runs (a dry run: what
    ``llmkit.kernels.aot`` compiles ahead of time without a GPU)."""
    rec = _Recorder(execute)
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


class Kernel:
    """A Triton kernel compiled (or interpreted) on first launch; ``kernel[grid](*args)``."""

    def __init__(self, fn: Callable, **jit_kwargs: Any) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.jit_kwargs = jit_kwargs
        self._compiled = None
        self._interpreted = None
        self.__doc__ = fn.__doc__

    def _impl(self, device: torch.device):
        if interpreter_enabled():
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction

                self._interpreted = InterpretedFunction(self.fn, **self.jit_kwargs)
            return self._interpreted
        if device.type != "cuda":
            raise KernelLaunchError(
                f"{self.name}: {unavailable_reason(device)}; got tensors on {device.type!r}")
        if self._compiled is None:
            from triton.runtime.jit import JITFunction

            self._compiled = JITFunction(self.fn, **self.jit_kwargs)
        return self._compiled

    def __getitem__(self, grid) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                          torch.device("cpu"))
            if _recorders:
                for rec in _recorders:
                    rec.append(Launch(self, grid, args, kwargs))
                if not _recorders[-1].execute:
                    return None
            impl = self._impl(device)
            launch_counts[self.name] += 1
            if impl is self._interpreted:
                with _library_calls_interpreted():
                    return impl[grid](*args, **kwargs)
            return impl[grid](*args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return f"<llmkit kernel {self.name}>"


_interpreted_callees: dict[int, Any] = {}


def _call_interpreted(self, *args: Any, **kwargs: Any) -> Any:
    """A Triton library function called from a kernel during an interpreted launch: run its
    interpreter rewrite directly. ``triton.language`` was patched for the interpreter once, by
    :func:`_library_calls_interpreted`; Triton's own ``InterpretedFunction.__call__`` would
    patch it again on every call (~5 ms each, a third of an interpreted launch)."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = self if isinstance(self, InterpretedFunction) else _interpreted_callees.get(id(self))
    if fn is None:
        fn = _interpreted_callees[id(self)] = InterpretedFunction(self.fn)
    return fn.rewrite()(*args, **kwargs)


@contextlib.contextmanager
def _library_calls_interpreted() -> Iterator[None]:
    """Make an interpreted launch independent of when ``triton.language`` was imported.

    Triton's library functions (``tl.sum``, ``tl.max``, ``tl.zeros`` ...) are ``@triton.jit``
    functions, made compiled-mode or interpreted according to ``TRITON_INTERPRET`` *at the time
    triton.language was imported*; compiled-mode ones cannot be called by the interpreter. For
    the duration of one interpreted launch, every library call goes through
    :func:`_call_interpreted`, with ``triton.language.core`` (the module those functions use)
    patched for the interpreter up front and restored afterwards (after the launch's own patch
    scope, so the restores nest). Falls back to Triton's plain behaviour if its interpreter's
    internals are not the ones this was written against (Triton 3.x)."""
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction, _patch_lang
        from triton.runtime.jit import JITFunction
        probe = standard.sum.fn if hasattr(standard.sum, "fn") else None
    except Exception:  # pragma: no cover - another Triton version
        yield
        return
    saved = {cls: cls.__dict__.get("__call__") for cls in (JITFunction, InterpretedFunction)}
    scope = _patch_lang(probe) if probe is not None else None
    for cls in saved:
        cls.__call__ = _call_interpreted  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, call in saved.items():
            if call is None:
                delattr(cls, "__call__")
            else:
                cls.__call__ = call  # type: ignore[method-assign]
        if scope is not None:
            scope.restore()


def jit(fn: Callable | None = None, **jit_kwargs: Any):
    """``@jit`` / ``@jit(do_not_specialize=[...])``: a :class:`Kernel`. A helper the kernel
    calls must be a :func:`device_function` (not ``@triton.jit``, whose kind depends on the
    import-time ``TRITON_INTERPRET``)."""
    if fn is None:
        return lambda f: Kernel(f, **jit_kwargs)
    return Kernel(fn, **jit_kwargs)


def device_function(fn: Callable) -> Any:
    """``@device_function``: a helper that ``@jit`` kernels call. It is always Triton's
    ``JITFunction``, whatever ``TRITON_INTERPRET`` said at import: the compiler inlines that
    kind, and an interpreted launch runs it through its interpreter rewrite
    (:func:`_call_interpreted`), as it does Triton's library functions."""
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


@contextlib.contextmanager
def count_launches() -> Iterator[collections.Counter[str]]:
    """``with count_launches() as c: ...``: ``c`` holds the launches made inside the block, per
    kernel name (filled when the block exits)."""
    before = launch_counts.copy()
    delta: collections.Counter[str] = collections.Counter()
    try:
        yield delta
    finally:
        delta.update(launch_counts)
        delta.subtract(before)
        for k in [k for k, v in delta.items() if v <= 0]:
            del delta[k]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full float32 for float32 tensors (tf32, Triton's default,
    would cost ~3 decimal digits and could flip a greedy token vs the torch backend); bf16 and
    fp16 run on tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
