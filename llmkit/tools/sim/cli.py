"""The ``llmkit sim`` command (called by ``llmkit.entrypoints.cli``).

    llmkit sim [MODEL] [hardware=NAME] [key=value ...] [-m]   simulate `bench serve`
    llmkit sim calibrate [sim.calibrate_output=PATH]          measure this CPU -> cpu-local
    llmkit sim calibrate engine [key=value ...]               ... and fit the cost model to
    llmkit sim calibrate MODEL [key=value ...]                timed steps of the real engine

``MODEL`` is what ``bench serve`` takes (a preset, an HF folder or a ``.gguf``; only its config
is read) or a named model shape (``llama-2-7b``, ...: ``sim.model=NAME``) or a ``config.json``.
Every ``bench.*`` and ``slo.*`` key means what it means for ``bench serve``; results go to
``<bench.output_dir>/sim-<time>.json`` (or ``sim-<key>=<value>.json`` per sweep point with
``-m``, or ``bench.result_name``) with a PNG beside it; ``llmkit bench plot DIR`` draws a sweep.

``sim calibrate engine`` runs the real engine of the configured model (the default preset, or
``model=NAME`` / ``model.path=PATH`` / ``model.dtype=...`` and any other engine key);
``sim calibrate MODEL`` names the model as ``serve`` and ``bench`` take it.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from llmkit.tools.schema import SimToolConfig

__all__ = ["SUBCOMMANDS", "SimError", "format_sim_block", "model_overrides", "run_sim_command"]

SUBCOMMANDS = ("calibrate",)
# `sim calibrate engine`: calibrate from the real engine of the configured model
ENGINE_WORD = "engine"


class SimError(Exception):
    """A simulation failure that is the user's to fix: one line."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def model_overrides(args: Any) -> list[str]:
    """A MODEL that names a shape (and no preset) or a config.json becomes ``sim.model``."""
    from llmkit.config.compose import model_presets
    from llmkit.cost_model.model_shape import shape_names

    model = args.model
    if model is None:
        return []
    if model in shape_names() and model not in model_presets():
        args.model = None
        return [f"sim.model={model}"]
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        args.model = None
        return [f"sim.model={path.resolve()}"]
    return []


def _devices(cm: dict) -> str:
    tp, pp = cm.get("tensor_parallel_size") or 1, cm.get("pipeline_parallel_size") or 1
    return f"{tp * pp} (TP={tp} x PP={pp})" if pp > 1 else str(tp)


def format_sim_block(result: dict) -> str:
    sim = result.get("sim") or {}
    hw = sim.get("hardware") or {}
    model = sim.get("model") or {}
    cm = sim.get("cost_model") or {}

    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [
        f"simulated: {model.get('name')} ({model.get('num_params', 0) / 1e9:.2f} B params, "
        f"{cm.get('dtype')}) on {hw.get('name')} x{_devices(cm)}",
        f"  KV pool {sim.get('num_kv_blocks')} blocks = {sim.get('kv_capacity_tokens')} tokens; "
        f"max_model_len {sim.get('max_model_len')}",
        f"  {sim.get('steps')} steps, mean {sim.get('mean_step_ms') or 0:.2f} ms "
        f"(max {sim.get('max_step_ms') or 0:.2f}); compute-bound "
        f"{pct(sim.get('compute_bound_fraction'))}; MFU {pct(sim.get('mfu'))}, "
        f"MBU {pct(sim.get('mbu'))}",
        f"  preemptions {sim.get('num_preemptions')}; prefix-cache hits "
        f"{sim.get('prefix_cache_hits')}/{sim.get('prefix_cache_queries')} tokens; "
        f"peak KV usage {pct(sim.get('peak_kv_usage'))}",
        f"  {sim.get('virtual_time_s') or 0:.2f} s simulated in {sim.get('wall_s') or 0:.2f} s",
    ]
    groups = sim.get("kv_groups") or []
    if len(groups) > 1 or any(not g["spec"].startswith("FullAttention(") for g in groups):
        lines[2:2] = [f"  KV group {g['spec']}: {len(g['layers'])} layers, "
                      f"{g['bytes_per_token']:.0f} B/token, {g['bytes_per_block']:.0f} B/block"
                      for g in groups]
    spec = sim.get("spec_decode")
    if spec:
        lines.append(
            f"  speculative {spec['method']} K={spec['num_speculative_tokens']}"
            f"{' adaptive' if spec['adaptive'] else ''} (ridge {spec['ridge_tokens']} tokens): "
            f"{spec['num_draft_tokens']} draft tokens, acceptance rate "
            f"{pct(spec['acceptance_rate'])}, mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}")
    return "\n".join(lines)


def _calibrate(args: Any, load_config: Callable[..., Any], out: Any) -> int:
    from llmkit.tools.sim.calibrate import format_calibration, run_calibrate, run_engine_calibrate

    if args.multirun:
        raise SimError("-m (multirun) does not apply to sim calibrate")
    if args.model is None:
        cfg = load_config(args, args.overrides, tool=SimToolConfig)
        path, profile = run_calibrate(cfg)
        print(format_calibration(profile), file=out)
        print(f"wrote {path} (used by hardware=cpu-local)", file=out)
        return 0
    if args.model == ENGINE_WORD:
        args.model = None  # the configured model
    cfg = load_config(args, args.overrides, tool=SimToolConfig)

    def log(line: str) -> None:
        print(line, file=out, flush=True)

    path, profile, fit, meas = run_engine_calibrate(cfg, log=log)
    print(f"fit over {len(fit.groups)} step shapes ({len(meas.samples)} steps): RMS error "
          f"{100 * fit.rms_rel_error:.1f}%, max {100 * fit.max_rel_error:.1f}%", file=out)
    for row in fit.table():
        print(f"  {row}", file=out)
    print(format_calibration(profile), file=out)
    print(f"wrote {path} (used by hardware=cpu-local; simulate this engine with sim.dtype="
          f"{meas.dtype})", file=out)
    return 0


def run_sim_command(args: Any, load_config: Callable[..., Any], out: Any = None) -> int:
    from llmkit.cost_model.model_shape import ShapeError
    from llmkit.tools.bench.datasets import WorkloadError

    out = out or sys.stdout
    try:
        if args.subcommand == "calibrate":
            return _calibrate(args, load_config, out)
        from llmkit.tools.bench.cli import sweep_points
        from llmkit.tools.bench.results import format_summary, result_stem, write_result
        from llmkit.tools.sim.replay import run_sim

        overrides = model_overrides(args) + list(args.overrides)
        points = sweep_points(overrides, args.multirun)
        # Compose every point first: a bad value fails before anything runs.
        configs = [(load_config(args, run, tool=SimToolConfig), sweep)
                   for run, sweep in points]
        for i, (cfg, sweep) in enumerate(configs):
            if len(configs) > 1:
                point = " ".join(f"{k}={v}" for k, v in sweep.items())
                print(f"[{i + 1}/{len(configs)}] {point}", file=out, flush=True)
            name = cfg.bench.result_name
            stem = result_stem(name, sweep) if name and sweep else result_stem("sim", sweep,
                                                                               name)
            result = run_sim(cfg, sweep=sweep)
            json_path, png_path = write_result(result, cfg.bench.output_dir, stem)
            print(format_summary(result["summary"], title="Simulated Serving Result"), file=out)
            print(format_sim_block(result), file=out)
            print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), file=out)
        if len(configs) > 1:
            print(f"plot the sweep: llmkit bench plot {configs[0][0].bench.output_dir}",
                  file=out)
        return 0
    except (WorkloadError, ShapeError, FileNotFoundError) as e:
        raise SimError(str(e)) from None
