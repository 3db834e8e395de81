"""CPU step graphs: the decode step compiled by ``torch.compile`` (inductor).

The platform's C++ kernels are custom ops with fake implementations, so inductor keeps them as
opaque calls and the graph computes exactly what eager computes (same kernels, same order, same
bits); what goes is the Python around them (module calls, the attention backend's branches,
the linear methods' row dispatch). With inductor's C++ wrapper (``compilation.cpp_wrapper``,
the default) the graph calls the kernels from C++.

Two graphs cover 1..``max_rows`` rows: one for a single row and one dynamic in the row count
for 2..``max_rows`` (dynamo specialises sizes 0 and 1).

Start-up: each graph is compiled ahead of time (``torch.compile(...).aot_compile``, dynamo's
precompile) and saved whole (guards, bytecode, the AOT-autograd and inductor output) to
``<compilation.cache_dir>/step_graphs/<key>-<graph>.bin``, so a later start with the same
model structure, config, torch and kernels loads it instead of tracing the model again (the
dynamo trace and AOT-autograd are most of a warm ``torch.compile``; inductor's own FX-graph
cache only saves the code generation). The model's weights and KV caches are no part of a
saved graph: it reads them from the live model at every call. The key (:func:`graph_key`) hashes
what shapes the graph; on load the traced functions' sources are compared with today's files
and the graph's guards are checked on the dummy inputs, and anything unloadable (stale,
corrupt, another torch) is traced again, with a log line.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from llmkit.compilation.base import StepGraphs

logger = logging.getLogger(__name__)

# Checks inductor inserts around every op call at run time; the graph's inputs are built by
# the runner with fixed layouts, so they only cost time (~1 us a call, hundreds a step).
_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}

#: Bumped when what a saved graph holds or how it is called changes.
FORMAT_VERSION = 1
_SCALARS = (bool, int, float, str, type(None))


def graph_key(model: torch.nn.Module, kv_caches: list[torch.Tensor], **parts: Any) -> str:
    """What a decode step's graph depends on, hashed: torch and Python, the model's structure
    (every module's class, its scalar attributes such as eps or scale, the classes of the
    objects it holds such as its linear method, each parameter's and buffer's name, shape,
    dtype and strides), the KV caches' shapes and dtype, and ``parts`` (rows, block-table
    width, options, the kernels' build key). Weights are not hashed: the graph reads them."""
    h = hashlib.sha256()

    def put(*items: object) -> None:
        for item in items:
            h.update(repr(item).encode())
            h.update(b"\0")

    put(FORMAT_VERSION, torch.__version__, sys.version, sorted(parts.items()))
    for name, module in model.named_modules():
        put(name, type(module).__module__, type(module).__qualname__)
        for attr, value in sorted(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules") or attr.startswith("__"):
                continue
            if isinstance(value, _SCALARS):
                put(attr, value)
            elif isinstance(value, torch.Tensor):
                put(attr, tuple(value.shape), value.dtype, value.stride())
            elif not isinstance(value, (dict, list, tuple, set)) or not attr.startswith("_"):
                put(attr, type(value).__module__, type(value).__qualname__)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        put(name, tuple(tensor.shape), tensor.dtype, tensor.stride())
    for kv in kv_caches:
        put(tuple(kv.shape), kv.dtype, kv.stride())
    return h.hexdigest()[:24]


def _sources_unchanged(fn: Any) -> str | None:
    """None when every function the saved graph traced still has the source it had; else
    which module changed."""
    import importlib
    import inspect

    from torch._dynamo.package import _hash_source

    for src in fn.source_info().inlined_sources:
        try:
            module = importlib.import_module(src.module)
            lines = inspect.getsourcelines(module)[0][src.firstlineno - 1:src.lastlineno - 1]
        except (ImportError, OSError, TypeError) as exc:
            return f"{src.module}: {exc}"
        if _hash_source("".join(lines)) != src.checksum:
            return f"{src.module} (line {src.firstlineno}) changed"
    return None


def op_namespace(name: str) -> Any:
    """``torch.ops.<name>`` (how a saved graph's guards refer to a custom-op library)."""
    return getattr(torch.ops, name)


def op_by_name(namespace: str, name: str, overload: str | None = None) -> Any:
    """``torch.ops.<namespace>.<name>[.<overload>]`` (how they refer to one of its ops)."""
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


@contextlib.contextmanager
def _portable_guard_pickling() -> Iterator[None]:
    """Work around two things torch 2.13's guard pickler gets wrong for this model:
    - it stands ``_Missing`` in for a module's attributes that no guard reads, by object id,
      so a module holding ``self.dtype = torch.float32`` turns *every* later reference to
      that singleton (each saved tensor's dtype) into ``_Missing`` and the saved graph cannot
      be loaded: dtypes and layouts are named globals, pickled by name here;
    - it pickles ``torch.ops.llmkit_cpu`` (which the ops objects hold) as an importable
      module, which it is not, and an op (which the quantized linear holds) field by field,
      down to a pybind function it cannot pickle: both are pickled by name here."""
    from torch._dynamo.guards import GuardsStatePickler

    reduce = GuardsStatePickler.reducer_override

    def by_name(self: Any, obj: Any) -> Any:
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return NotImplemented
        if isinstance(obj, torch._ops._OpNamespace):
            return op_namespace, (obj.name,)
        if isinstance(obj, torch._ops.OpOverloadPacket):  # holds a pybind function
            namespace, name = obj._qualified_op_name.split("::")
            return op_by_name, (namespace, name)
        if isinstance(obj, torch._ops.OpOverload):
            namespace, name = obj._schema.name.split("::")
            return op_by_name, (namespace, name, obj._overloadname)
        return reduce(self, obj)

    GuardsStatePickler.reducer_override = by_name
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = reduce


def _compiled_graph(fn: Any) -> Callable[..., Any] | None:
    """The compiled graph that dynamo's code for the precompiled ``fn`` calls (a global of
    that code, named by its backend id), or None where torch does not lay it out so."""
    name = getattr(getattr(fn, "_artifacts", None), "backend_id", None)
    scope = getattr(getattr(fn, "fn", None), "__globals__", None)
    return scope.get(name) if scope is not None and name is not None else None


def _graph_call_args(fn: Any, compiled: Callable[..., Any], step: Any,
                     inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...] | None:
    """What dynamo's code for ``fn`` passes ``compiled`` (its graph) when called on
    ``inputs`` (one call, whose first output is the step's result), else None."""
    code, name = fn.fn, fn._artifacts.backend_id
    scope = code.__globals__
    calls: list[tuple[tuple[Any, ...], Any]] = []

    def spy(*args: Any) -> Any:
        out = compiled(*args)
        calls.append((args, out))
        return out

    scope[name] = spy
    try:
        result = code(step, *inputs)
    finally:
        scope[name] = compiled
    if len(calls) != 1:
        return None
    args, out = calls[0]
    if not (isinstance(out, (list, tuple)) and out and out[0] is result):
        return None
    return args


def direct_call(fn: Any, step: Any, *recordings: tuple[torch.Tensor, ...]
                ) -> Callable[..., torch.Tensor] | None:
    """The precompiled graph ``fn`` called without its Python prologue, or None where that
    cannot be shown to be the same call.

    Dynamo's code for a step gathers every graph input from the model on each call (one
    attribute chain per weight, KV cache and buffer: ~500 attribute loads for a 30-layer
    model) before it calls the compiled graph. Those objects are the model's own and are never
    replaced while the engine runs (weights, caches and LoRA slots change in place), so the
    argument list is recorded once, from calls on ``recordings`` (step inputs), and later calls
    put their five step tensors into it. A dynamic graph's call also carries its row count:
    recorded at two row counts, an argument equal to the row count in each is the row count.
    Kept only when every argument is explained: a step input (each in exactly one place), the
    same tensor in every recording, or the row count. Code that replaced a tensor the graph
    reads (instead of writing into it) after this would have to make the graphs again, as a
    new KV cache does. The recording calls run the graph (they warm it up)."""
    compiled = _compiled_graph(fn)
    if compiled is None:
        return None
    records = [_graph_call_args(fn, compiled, step, inputs) for inputs in recordings]
    if not records or any(r is None for r in records) or len({len(r) for r in records}) != 1:
        return None
    rows = [inputs[0].shape[0] for inputs in recordings]
    rows_tell = len(set(rows)) == len(rows) > 1
    step_slots: list[tuple[int, int]] = []  # (argument, step input)
    row_slots: list[int] = []
    for j, column in enumerate(zip(*records)):
        k = next((k for k, x in enumerate(recordings[0]) if column[0] is x), None)
        if k is not None:
            if not all(c is inputs[k] for c, inputs in zip(column, recordings)):
                return None
            step_slots.append((j, k))
        elif isinstance(column[0], torch.Tensor):
            if not all(c is column[0] for c in column):
                return None
        elif rows_tell and all(type(c) is int and c == n for c, n in zip(column, rows)):
            row_slots.append(j)
        else:
            return None
    if sorted(k for _, k in step_slots) != list(range(len(recordings[0]))):
        return None
    template = list(records[0])

    def call(*step_inputs: torch.Tensor) -> torch.Tensor:
        a = template.copy()
        for j, k in step_slots:
            a[j] = step_inputs[k]
        if row_slots:
            n = step_inputs[0].shape[0]
            for j in row_slots:
                a[j] = n
        return compiled(*a)[0]

    return call


class _DecodeStep:
    """What a graph is traced through and called with: the model, its attention backend and
    the KV caches, and nothing else. Dynamo's precompile pickles the traced function's locals
    (pruned to what its guards read) with the graph, so they must not reach the step graphs
    object (which holds the compiled graphs themselves)."""

    decode_step = StepGraphs.decode_step

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self.model = model
        self.attn_backend = model.attn_backend
        self.kv_caches = kv_caches


class InductorStepGraphs(StepGraphs):
    name = "inductor"
    capture_in_background = True

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_rows: int,
                 *, cpp_wrapper: bool = True, cache_dir: str | None = None,
                 kernels_key: str = "") -> None:
        super().__init__(model, kv_caches, max_rows)
        if cache_dir is not None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            # inductor reads its cache folder from the environment, at compile time
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        options = dict(_OPTIONS, cpp_wrapper=cpp_wrapper)
        self.cpp_wrapper = cpp_wrapper
        self.options = options
        self.kernels_key = kernels_key
        # Saved graphs live beside inductor's cache (null: not saved, every start traces).
        self.graph_dir = Path(cache_dir) / "step_graphs" if cache_dir is not None else None
        self._step = _DecodeStep(model, kv_caches)
        self._fn = torch.compile(self._step.decode_step, fullgraph=True, dynamic=False,
                                 options=options)
        # "one" (1 row) and "many" (2..max_rows): (graph, whether it takes the step first:
        # a precompiled graph does, the plain torch.compile fallback does not).
        self._graphs: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {}
        #: How the graphs of the latest capture() came: graph name -> loaded, traced, or
        #: compiled (the plain torch.compile path, when AOT compilation failed).
        self.origins: dict[str, str] = {}
        # The block-table width load_saved() last ran for (None: not yet).
        self._width: int | None = None
        # Graphs called without dynamo's prologue (direct_call), where it could be recorded.
        self._direct: dict[str, Callable[..., torch.Tensor]] = {}

    def _variants(self) -> list[tuple[str, int]]:
        variants = [("one", 1)]
        if self.max_rows >= 2:
            variants.append(("many", self.max_rows))
        return variants

    def _key(self, block_table_width: int) -> str:
        return graph_key(self.model, self.kv_caches, max_rows=self.max_rows,
                         block_table_width=block_table_width,
                         options=sorted(self.options.items()), kernels=self.kernels_key,
                         # a graph guards on torch's thread count: one saved graph per count
                         num_threads=torch.get_num_threads())

    def load_saved(self, block_table_width: int) -> bool:
        """Load (and warm up) the graphs an earlier start saved; whether every one was there
        and still fits. What is missing, :meth:`capture` traces."""
        self._graphs.clear()
        self.origins.clear()
        self._direct.clear()
        self._width = block_table_width
        if self.graph_dir is None:
            return False
        key = self._key(block_table_width)
        with torch.inference_mode():
            for variant, rows in self._variants():
                graph = self._load(self.graph_dir / f"{key}-{variant}.bin",
                                   self.dummy_inputs(rows, block_table_width))
                if graph is not None:
                    self.origins[variant] = "loaded"
                    self._ready(variant, graph, self.dummy_inputs(rows, block_table_width))
        return len(self._graphs) == len(self._variants())

    def capture(self, block_table_width: int) -> float:
        """Load what :meth:`load_saved` has not loaded yet (unless it ran for this width just
        before), trace the rest. The warm-up runs write no KV (the dummy slots are -1) and
        read block 0, so this may run beside eager steps on another thread (the runner's
        background capture); the graphs are not run by anyone else until it returns."""
        t0 = time.perf_counter()
        if self._width != block_table_width:
            self.load_saved(block_table_width)
        key = self._key(block_table_width)
        with torch.inference_mode():
            for variant, rows in self._variants():
                if variant in self._graphs:
                    continue
                path = self.graph_dir / f"{key}-{variant}.bin" if self.graph_dir else None
                graph = self._trace(path, self.dummy_inputs(rows, block_table_width))
                self._ready(variant, graph, self.dummy_inputs(rows, block_table_width))
        if self.origins:
            logger.info("step graphs: %s", ", ".join(f"{v} {o}" for v, o in self.origins.items()))
        return time.perf_counter() - t0

    def _ready(self, variant: str, graph: tuple[Callable[..., torch.Tensor], bool],
               inputs: tuple[torch.Tensor, ...]) -> None:
        """Make ``graph`` the one ``run`` uses for ``variant``: its call recorded
        (``direct_call``; the dynamic graph at its smallest and largest row counts), which
        warms it up, else warmed up on ``inputs``. Every input writes no KV."""
        self._graphs[variant] = graph
        fn, takes_step = graph
        direct = None
        if takes_step:
            width = inputs[3].shape[1]
            sizes = (1,) if variant == "one" else (2, self.max_rows)
            direct = direct_call(fn, self._step, *(self.dummy_inputs(n, width) for n in sizes))
            if direct is None:
                logger.info("step graph %s: called through dynamo's prologue (its inputs "
                            "could not be recorded)", variant)
        if direct is None:
            self.run(*inputs)  # warm up
        else:
            self._direct[variant] = direct

    def _mark(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if inputs[0].shape[0] >= 2:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0, min=2, max=self.max_rows)

    def _load(self, path: Path, inputs: tuple[torch.Tensor, ...]
              ) -> tuple[Callable[..., torch.Tensor], bool] | None:
        """The saved graph at ``path`` if it is there and still fits; else None (and why, in
        the log, unless there was nothing saved)."""
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(
                    f, f_globals=StepGraphs.decode_step.__globals__)
            stale = _sources_unchanged(fn)
            if stale is None and not fn.guard_check(self._step, *inputs):
                verbose = fn._artifacts.guard_manager.check_verbose(
                    fn.prepare_f_locals(self._step, *inputs))
                stale = f"its guards fail on this model's inputs: {verbose.verbose_code_parts}"
        except Exception as exc:  # noqa: BLE001 - any unloadable entry is traced again
            logger.debug("loading %s", path, exc_info=True)
            stale = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if stale is not None:
            logger.warning("step graph %s not loaded (%s); tracing it again", path, stale)
            return None
        fn.disable_guard_check()  # checked above; the runner builds inputs of these layouts
        return fn, True

    def _trace(self, path: Path | None, inputs: tuple[torch.Tensor, ...]
               ) -> tuple[Callable[..., torch.Tensor], bool]:
        """Compile the graph ahead of time (and save it under ``path``); when dynamo cannot
        precompile it, the plain ``torch.compile`` function (traced again at every start)."""
        variant = "one" if inputs[0].shape[0] == 1 else "many"
        self._mark(inputs)
        try:
            with _portable_guard_pickling():
                fn = self._fn.aot_compile((inputs, {}))
        except Exception as exc:  # noqa: BLE001 - the plain compile path still works
            logger.warning("step graph %s: ahead-of-time compilation failed (%s); using "
                           "torch.compile, traced at every start", variant,
                           f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                           exc_info=logger.isEnabledFor(logging.DEBUG))
            self.origins[variant] = "compiled"
            return self._fn, False
        self.origins[variant] = "traced"
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fn.save_compiled_function(str(path))
            except Exception as exc:  # noqa: BLE001 - a graph that cannot be saved still runs
                logger.warning("step graph %s not saved to %s (%s); the next start traces it "
                               "again", variant, path, f"{type(exc).__name__}: {exc}"[:300])
        fn.disable_guard_check()
        return fn, True

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        variant = "one" if rows == 1 else "many"
        direct = self._direct.get(variant)
        if direct is not None:
            return direct(input_ids, positions, slot_mapping, block_table, seq_lens)
        fn, takes_self = self._graphs[variant]
        if takes_self:
            return fn(self._step, input_ids, positions, slot_mapping, block_table, seq_lens)
        if rows >= 2:
            self._mark((input_ids, positions, slot_mapping, block_table, seq_lens))
        return fn(input_ids, positions, slot_mapping, block_table, seq_lens)
