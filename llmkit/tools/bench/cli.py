"""The ``llmkit bench serve|throughput|latency|plot`` commands (called by
``llmkit.entrypoints.cli``).

    llmkit bench serve [MODEL] [key=value ...] [-m]       load test a running server
    llmkit bench throughput [MODEL] [baseline=hf] [...]   offline LLM throughput (+ HF baseline)
    llmkit bench latency [MODEL] [...]                     one batch, per-step timing
    llmkit bench plot [DIR]                                a sweep's results against the swept value

With ``-m`` each point of the sweep (``bench.rate=1,2,4``) runs in turn and writes
``<bench.output_dir>/<kind>-<key>=<value>.json`` (serve: and ``.png``); ``bench plot DIR`` then
draws them. ``baseline=NAME`` is short for ``bench.baseline=NAME``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from llmkit.tools.bench.datasets import WorkloadError
from llmkit.tools.schema import BenchToolConfig

__all__ = ["SUBCOMMANDS", "rewrite_shorthands", "run_bench", "sweep_points"]

SUBCOMMANDS = ("serve", "throughput", "latency", "plot")
# bare keys accepted on the bench command line as shorthands for bench.<key>
SHORTHANDS = ("baseline",)


class BenchError(Exception):
    """A bench failure that is the user's to fix (bad dataset file, no server): one line."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def rewrite_shorthands(overrides: Sequence[str]) -> list[str]:
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        out.append(f"bench.{key}={value}" if sep and key in SHORTHANDS else o)
    return out


def sweep_points(overrides: Sequence[str], multirun: bool) -> list[tuple[list[str], dict]]:
    """``(override list, {swept key: value})`` per run; one run without ``-m``."""
    if not multirun:
        return [(list(overrides), {})]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from llmkit.config.compose import expand_overrides
    from llmkit.tools.compose import TOOLS_ROOT

    runs = expand_overrides(overrides, TOOLS_ROOT)
    parser = OverridesParser.create()
    swept = [o.key_or_group for o in parser.parse_overrides(list(overrides))
             if o.is_sweep_override()]
    points = []
    for run in runs:
        values = {o.key_or_group: o.value() for o in parser.parse_overrides(run)}
        points.append((run, {k: values.get(k) for k in swept}))
    return points


def _stem(kind: str, sweep: dict, name: str | None) -> str:
    from llmkit.tools.bench.results import result_stem

    if name and sweep:
        return result_stem(name, sweep)
    return result_stem(kind, sweep, name)


def _run_one(sub: str, cfg: Any, sweep: dict, out: Any) -> tuple[Path, Path | None]:
    from llmkit.tools.bench.results import format_summary, write_json, write_result

    b = cfg.bench
    stem = _stem(sub, sweep, b.result_name)
    if sub == "serve":
        from llmkit.tools.bench.serve import run_serve

        result = run_serve(cfg, sweep=sweep)
        json_path, png_path = write_result(result, b.output_dir, stem)
        print(format_summary(result["summary"]), file=out)
    elif sub == "throughput":
        from llmkit.tools.bench.throughput import format_throughput, run_throughput

        result = run_throughput(cfg, sweep=sweep)
        json_path, png_path = write_json(result, Path(b.output_dir) / f"{stem}.json"), None
        print(format_throughput(result), file=out)
    else:
        from llmkit.tools.bench.latency import format_latency, run_latency

        result = run_latency(cfg, sweep=sweep)
        json_path, png_path = write_json(result, Path(b.output_dir) / f"{stem}.json"), None
        print(format_latency(result), file=out)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), file=out)
    return json_path, png_path


def _plot(args: Any, load_config: Callable[..., Any], out: Any) -> int:
    from llmkit.tools.bench.plot import plot_sweep

    if args.multirun:
        raise BenchError("-m (multirun) does not apply to bench plot", code=2)
    directory = args.model
    if directory is None:
        directory = load_config(args, rewrite_shorthands(args.overrides),
                                tool=BenchToolConfig).bench.output_dir
    if not Path(directory).is_dir():
        raise BenchError(f"bench plot: {directory!r} is not a directory of results", code=2)
    try:
        path, table = plot_sweep(directory)
    except FileNotFoundError as e:
        raise BenchError(str(e), code=2) from None
    print(table, file=out)
    print(f"wrote {path}", file=out)
    return 0


def graphs_before_timing(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with ``compilation.background=false`` first, unless they set it: time the
    engine users run, not one whose step graphs compile beside the timed steps on a cold cache
    and swap in mid-run (or never, in a short run)."""
    if any(o.lstrip("+~").startswith("compilation.background=") for o in overrides):
        return list(overrides)
    return ["compilation.background=false", *overrides]


def run_bench(args: Any, load_config: Callable[..., Any], out=None) -> int:
    """Run ``args.subcommand``; ``load_config(args, overrides, tool=BenchToolConfig)``
    composes one run's config."""
    out = out or sys.stdout
    sub = args.subcommand
    if sub is None:
        raise BenchError("bench needs a sub-command: " + "|".join(SUBCOMMANDS)
                         + " (e.g. llmkit bench serve bench.rate=4)", code=2)
    try:
        if sub == "plot":
            return _plot(args, load_config, out)
        overrides = rewrite_shorthands(args.overrides)
        if sub in ("latency", "throughput"):
            overrides = graphs_before_timing(overrides)
        points = sweep_points(overrides, args.multirun)
        # Compose every point first: a bad value fails before anything runs.
        configs = [(load_config(args, run, tool=BenchToolConfig), sweep)
                   for run, sweep in points]
        allowed = {"throughput": {"none", "hf", "llamacpp"}, "latency": {"none", "llamacpp"}}
        for c, _ in configs:
            if c.bench.baseline not in allowed.get(sub, {"none"}):
                raise BenchError(f"bench.baseline={c.bench.baseline} does not apply to bench "
                                 f"{sub} (throughput: hf, llamacpp; latency: llamacpp)", code=2)
        engine_keys = [k for k in points[0][1]
                       if sub == "serve" and not k.startswith(("bench.", "slo."))]
        if engine_keys:
            print(f"note: bench serve does not restart the server; sweeping "
                  f"{', '.join(engine_keys)} changes nothing on its side", file=sys.stderr)
        for i, (cfg, sweep) in enumerate(configs):
            if len(configs) > 1:
                point = " ".join(f"{k}={v}" for k, v in sweep.items())
                print(f"[{i + 1}/{len(configs)}] {point}", file=out, flush=True)
            _run_one(sub, cfg, sweep, out)
        if len(configs) > 1:
            print(f"plot the sweep: llmkit bench plot {configs[0][0].bench.output_dir}",
                  file=out)
        return 0
    except WorkloadError as e:
        raise BenchError(str(e), code=2) from None
    except Exception as e:
        import httpx

        if isinstance(e, httpx.HTTPError):
            raise BenchError(f"cannot reach the server: {type(e).__name__}: {e} (set "
                             "bench.base_url=http://HOST:PORT)") from None
        raise
