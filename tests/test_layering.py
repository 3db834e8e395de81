"""The import graph of llmkit: no cycles among its modules (nor among its packages), and no
arrow up the layers.

Every ``import`` of every module counts, at module level or inside a function (a lazy import
is still a dependency), and so do a ``Registry.register_lazy`` class path and an
``importlib.import_module`` of a literal name. Imports under
``if TYPE_CHECKING:`` do not: they annotate a protocol the caller satisfies and never run.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# where each importable root lives in the repository (pyproject.toml's package-dir)
SOURCE_ROOTS = {"llmkit": REPO / "llmkit", "llmkit.kernels": REPO / "kernels"}

# The layers, top to bottom, by llmkit's top-level package or module (``llmkit.<name>``): a
# module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, set[str]]] = [
    # the package root: re-exports the public names (LLM, SamplingParams, ...) for users
    ("facade", {""}),
    # the CLI, the OpenAI server, the terminal chat: they run the engine and the tools
    ("entrypoints", {"entrypoints"}),
    # tools beside the engine (llmkit/tools/: bench, sim, plan, eval, proxy): they drive it through
    # its public API (TOOLS_PUBLIC below), it never imports them
    ("tools", {"tools"}),
    # the front ends (LLM, AsyncLLM), the core loop and its process
    ("engine", {"engine"}),
    # what the core assembles: who runs when, where KV lives, who computes, and how (lora:
    # the runner's adapters and the LoRA methods it wraps the model's linear methods in)
    ("runtime", {"scheduler", "kv_cache", "kv_transfer", "worker", "executor", "spec_decode",
                 "compilation", "platforms", "structured_output", "lora"}),
    # what a step computes: the model, its attention, sampling, linear methods and ops
    # (cost_model: what a step costs on a modelled device; the simulator prices steps with it
    # and scheduler=slo predicts them with it, so it sits below both)
    ("model", {"models", "attention", "sampling", "linear", "ops", "request", "multimodal",
               "distributed", "cost_model"}),
    # kernels (C++, Triton) with their torch references
    ("kernels", {"kernels"}),
    # plain data and the machinery every layer uses
    ("base", {"config", "registry", "outputs", "facts", "startup"}),
]

# Narrower rules on top of the layers: these packages may import only what is listed
# (and themselves).
ONLY = {
    # the platform picks linear methods, ops, step graphs and kernels for a device; it never
    # sees the models it serves nor the engine that asks
    "platforms": {"linear", "ops", "compilation", "kernels", "config", "registry"},
    # proposers are called by the worker (after sampling) and read its batch through
    # spec_decode.base.ProposerBatch: no arrow back into the worker, the engine or the scheduler
    "spec_decode": {"models", "attention", "sampling", "linear", "ops", "request", "kernels",
                    "config", "registry", "outputs", "facts", "startup"},
    # the cost model reads a model's shape and a device's profile: never the runtime that asks
    # it (the scheduler) nor the tools that replay steps with it
    "cost_model": {"distributed", "models", "attention", "config", "registry", "facts",
                   "startup"},
    # the cache folder, the build: nothing of the components that call them
    "kernels": {"config", "startup"},
    # below everything
    "config": set(),
    "registry": set(),
    "outputs": set(),
    "facts": set(),
    "startup": set(),
}

# What the tools may import of the engine: its public API (the config, ``LLM``,
# ``SamplingParams``, outputs, ``LoRARequest``), its step observers, the cost model (the
# simulator prices steps with the one scheduler=slo predicts them with), and the interfaces an
# executor plugin implements (``executor=sim`` registers through an entry point as a third
# party's executor would). A module, or a package with everything under it (``.*``).
TOOLS_PUBLIC = {
    "llmkit.config.*", "llmkit.outputs", "llmkit.sampling.params", "llmkit.lora.request",
    "llmkit.engine.llm", "llmkit.engine.observe.observer", "llmkit.engine.observe.step_trace",
    "llmkit.executor.base", "llmkit.scheduler.base", "llmkit.cost_model.*",
}

# Where a tool reaches past that API today, and why. The list may only shrink: an entry that
# is no longer used fails the test too (delete it), a new reach fails until it goes through
# the public API or is listed here with its reason.
TOOLS_REACH: dict[str, set[str]] = {
    # the simulator runs the engine's own core, scheduler and KV cache on a virtual clock: it
    # builds EngineCore with its SimExecutor and feeds it Requests directly
    "llmkit.tools.sim.replay": {"llmkit.engine.loop.core", "llmkit.platforms", "llmkit.request"},
    # calibrate times the real scheduler + KV cache manager without a model
    "llmkit.tools.sim.calibrate": {"llmkit.kv_cache", "llmkit.scheduler", "llmkit.request",
                                   "llmkit.platforms", "llmkit.platforms.cpu"},
    "llmkit.tools.sim.engine_measure": {"llmkit.platforms", "llmkit.request"},
    # where a model's config.json / tokenizer lies (a preset, a folder, a .gguf), as the engine
    # resolves it
    "llmkit.tools.sim.source": {"llmkit.models.loader", "llmkit.models.max_model_len"},
    "llmkit.tools.bench.serve": {"llmkit.models.loader"},
    # the simulated draft length follows the engine's adaptive policy
    "llmkit.tools.sim.speculation": {"llmkit.spec_decode.adaptive"},
    # a model with several KV-cache groups: the simulated pool is laid out by the runner's own
    # plan (groups, block size, bytes a block), so the real hybrid manager runs on it
    "llmkit.tools.sim.executor": {"llmkit.worker.kv_cache_setup", "llmkit.kv_cache.groups",
                                  "llmkit.attention.base"},
}

# The only modules outside llmkit/tools/ that import a tool: the command line runs them (and
# its --help lists their keys and groups).
TOOLS_IMPORTED_BY = {"llmkit.entrypoints.cli", "llmkit.entrypoints.command_help"}

# The engine's parts, top to bottom, by the name under ``llmkit.engine`` (a module or a
# subpackage): a part may import its own and those below it. The front ends drive the engine in
# one of three ways; data parallel is N process hops; the process hop runs the core loop in a
# child; the loop reports to its observers and implements the protocol the front ends program
# against. ``client.py`` sits beside the front ends in the package ``llmkit.engine``, so the parts
# below name it under ``if TYPE_CHECKING:`` only: a run-time import would make the packages a
# cycle (test_the_engines_packages_import_no_cycle).
ENGINE_PARTS: list[tuple[str, set[str]]] = [
    ("front ends", {"llm", "async_llm", "frontend", "beam_search", "output_processor",
                    "request_tracker"}),
    ("data parallel", {"dp"}),
    ("process hop", {"process"}),
    ("core loop", {"loop"}),
    ("observers and the engine protocol", {"observe", "client"}),
]


def _module_files() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for root, folder in SOURCE_ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if root == "llmkit" and parts and parts[0] == "kernels":
                continue  # llmkit/kernels does not exist; kernels/ is llmkit.kernels
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([root, *parts])] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[str, int, int]]:
    """``(module or module.name, relative level, line)`` of every import outside
    ``if TYPE_CHECKING:`` blocks, of every ``register_lazy(name, "class.path")`` and of every
    ``importlib.import_module("literal")``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, 0, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found.extend((f"{base}.{a.name}" if base else a.name, node.level, node.lineno)
                         for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "register_lazy" and len(node.args) == 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.append((node.args[1].value.rpartition(".")[0], 0, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, 0, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported llmkit module: line of the first such import}."""
    mods = _module_files()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for target, level, line in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package
                for _ in range(level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{target}" if target else base
            if not (target == "llmkit" or target.startswith("llmkit.")):
                continue
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg
            dep = target if target in mods else resolve(target)
            if dep and dep != name:
                edges.setdefault(dep, line)
        graph[name] = edges
    return graph


def component(module: str) -> str:
    """``llmkit.<name>`` of a module: its top-level package or module ("" for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(comp: str) -> int:
    for i, (_, comps) in enumerate(LAYERS):
        if comp in comps:
            return i
    raise KeyError(comp)


def where(module: str) -> str:
    return str(_module_files()[module].relative_to(REPO))


def test_the_parser_sees_lazy_and_module_level_imports():
    g = import_graph()
    assert "llmkit.engine.loop.core" in g["llmkit.tools.sim.replay"]  # inside a function
    assert "llmkit.scheduler.base" in g["llmkit.engine.loop.core"] or \
        "llmkit.scheduler" in g["llmkit.engine.loop.core"]
    assert "llmkit.executor.uniproc" in g["llmkit.executor"]  # a register_lazy path
    assert "llmkit.kv_cache.block_pool" not in g["llmkit.kv_cache.base"]  # TYPE_CHECKING only
    assert "llmkit.entrypoints.offline" in g["llmkit.entrypoints.cli"]  # importlib, by name


def test_every_component_has_a_layer():
    comps = {component(m) for m in import_graph()}
    placed = set().union(*(c for _, c in LAYERS))
    assert comps - placed == set(), "place these in LAYERS (tests/test_layering.py)"


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's): each is a set of
    nodes that import each other, directly or round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def package_of(module: str) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, its parent for a
    plain module, except the root's plain modules (``llmkit.request``, ``llmkit.outputs``...),
    each its own component (LAYERS places them apart: the facade on top, the rest at the bottom)."""
    if _module_files()[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "llmkit" else parent


def package_graph() -> dict[str, dict[str, tuple[str, str]]]:
    """package -> {imported package: (module, imported module) of one such import}."""
    graph: dict[str, dict[str, tuple[str, str]]] = {}
    for module, deps in import_graph().items():
        src = package_of(module)
        edges = graph.setdefault(src, {})
        for dep in deps:
            if (dst := package_of(dep)) != src:
                edges.setdefault(dst, (module, dep))
    return graph


def test_the_engines_packages_import_no_cycle():
    """Modules without a cycle can still make packages that import each other (a module of
    ``llmkit.engine`` imports ``llmkit.engine.process``, whose module imports another of
    ``llmkit.engine``): then neither package can be read, moved or tested without the other.
    The engine's packages (``llmkit.engine`` and every subpackage) form none."""
    graph = package_graph()
    bad = [c for c in import_cycles(graph)
           if any(p == "llmkit.engine" or p.startswith("llmkit.engine.") for p in c)]
    lines = []
    for cycle in bad:
        lines.append(" <-> ".join(cycle))
        lines += [f"  {a} -> {b}: {graph[a][b][0]} imports {graph[a][b][1]}"
                  for a in cycle for b in cycle if b in graph[a]]
    assert not bad, "the engine's packages import each other:\n" + "\n".join(lines)


# Package cycles still standing, a package and its own subpackages that share one concept;
# test_no_package_imports_each_other names any other. Remove an entry once its cycle is gone
# (none stand: the last, models <-> models.loader, went when the models package stopped
# re-exporting the loader and the GGUF config/tokenizer moved to models.gguf_metadata).
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = set()


def test_no_package_imports_each_other():
    """No two packages of the whole tree import each other (beyond KNOWN_PACKAGE_CYCLES): a
    cross-package cycle (the ops naming the attention metadata the attention backends built
    over the ops pass them) or a parent and its child (the server's package importing the
    CLI's for its metrics) leaves neither readable, movable or testable alone."""
    graph = package_graph()
    bad = [c for c in import_cycles(graph) if frozenset(c) not in KNOWN_PACKAGE_CYCLES]
    lines = []
    for cycle in bad:
        lines.append(" <-> ".join(cycle))
        lines += [f"  {a} -> {b}: {graph[a][b][0]} imports {graph[a][b][1]}"
                  for a in cycle for b in cycle if b in graph[a]]
    assert not bad, "packages import each other:\n" + "\n".join(lines)


def test_the_known_package_cycles_still_stand():
    """An entry of KNOWN_PACKAGE_CYCLES that no longer is a cycle goes (the exception list
    only shrinks)."""
    cycles = {frozenset(c) for c in import_cycles(package_graph())}
    assert KNOWN_PACKAGE_CYCLES <= cycles, KNOWN_PACKAGE_CYCLES - cycles


def test_no_arrow_runs_up_the_layers():
    bad = []
    for module, deps in sorted(import_graph().items()):
        src = component(module)
        for dep, line in sorted(deps.items()):
            dst = component(dep)
            if dst == src:
                continue
            allowed = ONLY.get(src)
            if allowed is not None and dst not in allowed:
                bad.append(f"{where(module)}:{line}: {module} -> {dep} ({src} may import only "
                           f"{', '.join(sorted(allowed)) or 'nothing of llmkit'})")
            elif layer_of(dst) < layer_of(src):
                bad.append(f"{where(module)}:{line}: {module} -> {dep} (layer "
                           f"{LAYERS[layer_of(src)][0]} -> {LAYERS[layer_of(dst)][0]})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _public_to_tools(module: str) -> bool:
    return any(module == p or (p.endswith(".*") and (module + ".").startswith(p[:-1]))
               for p in TOOLS_PUBLIC)


def test_tools_use_only_the_engines_public_api():
    bad, used = [], set()
    for module, deps in sorted(import_graph().items()):
        if component(module) != "tools":
            continue
        for dep, line in sorted(deps.items()):
            if component(dep) == "tools" or _public_to_tools(dep):
                continue
            if dep in TOOLS_REACH.get(module, ()):
                used.add((module, dep))
                continue
            bad.append(f"{where(module)}:{line}: {module} -> {dep} (not the engine's public "
                       "API: go through it, or list the reach and why in TOOLS_REACH)")
    stale = {(m, d) for m, deps in TOOLS_REACH.items() for d in deps} - used
    bad += [f"TOOLS_REACH lists {m} -> {d}, which no longer imports it: delete the entry"
            for m, d in sorted(stale)]
    assert not bad, "\n".join(bad)


def test_only_the_command_line_imports_the_tools():
    bad = [f"{where(module)}:{line}: {module} -> {dep}"
           for module, deps in sorted(import_graph().items())
           if component(module) != "tools" and module not in TOOLS_IMPORTED_BY
           for dep, line in sorted(deps.items()) if component(dep) == "tools"]
    assert not bad, "the engine (and everything but the CLI) never imports a tool:\n" + \
        "\n".join(bad)


def engine_part(module: str) -> int | None:
    """The index in ENGINE_PARTS of an engine module (None for the package itself)."""
    parts = module.split(".")
    if len(parts) < 3:
        return None
    for i, (_, names) in enumerate(ENGINE_PARTS):
        if parts[2] in names:
            return i
    raise KeyError(f"place {module} in ENGINE_PARTS (tests/test_layering.py)")


def test_engine_parts_import_only_downwards():
    bad = []
    for module, deps in sorted(import_graph().items()):
        if component(module) != "engine" or (src := engine_part(module)) is None:
            continue
        for dep, line in sorted(deps.items()):
            if component(dep) == "engine" and (dst := engine_part(dep)) is not None and dst < src:
                bad.append(f"{where(module)}:{line}: {module} -> {dep} ({ENGINE_PARTS[src][0]} "
                           f"-> {ENGINE_PARTS[dst][0]})")
    assert not bad, "imports up the engine's parts:\n" + "\n".join(bad)


def test_engine_core_process_module_loads_without_torch():
    """The engine-core process sets OpenMP's wait policy before torch loads (a spinning
    libgomp slows every other job on the cores 10x): importing its module must not load torch."""
    import subprocess
    import sys

    code = "import sys, llmkit.engine.process.core; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
