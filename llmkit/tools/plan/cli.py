"""The ``llmkit plan`` command (called by ``llmkit.entrypoints.cli``).

    llmkit plan [MODEL] [plan.rate=R plan.num_requests=N plan.input_len=I plan.output_len=O |
                 plan.trace=FILE | bench.*=...] [slo.*=...] [plan.*=...] [engine keys]

Without ``hardware=`` it plans for this machine (``hardware=cpu-local``), calibrating the
engine first (``llmkit sim calibrate engine``, cached) when no calibrated profile exists, and
checking a cached one against a few timed engine steps (``profile_check``).
Progress goes to stderr; the table, the verification's agreement line and the files written go
to stdout. Engine keys on the command line apply to every candidate (the searched keys aside)
and to the verification servers.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from llmkit.config.errors import ConfigError
from llmkit.tools.plan.errors import PlanError
from llmkit.tools.schema import TOOL_SECTIONS, PlanToolConfig

if TYPE_CHECKING:
    from llmkit.tools.plan.space import SearchSpace

__all__ = ["PlanError", "run_plan_command"]

# the bench.* keys that make a workload (what plan.trace takes from a result file)
WORKLOAD_KEYS = ("endpoint", "dataset", "dataset_path", "num_requests", "input_len",
                 "output_len", "range_ratio", "num_prefixes", "prefix_len", "prompt_format",
                 "tokenizer", "rate", "arrival", "max_concurrency", "max_duration_s", "seed",
                 "ignore_eos", "temperature")


# plan.<key> that stand for bench.<key> (API.md's short form of a workload)
SHORT_WORKLOAD_KEYS = ("rate", "num_requests", "input_len", "output_len")


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def apply_workload(cfg: PlanToolConfig, overrides: list[str]) -> PlanToolConfig:
    """The workload to plan for: ``plan.trace``'s (and, unless ``slo.*`` is on the command
    line, its SLO: a ``bench serve`` / ``llmkit sim`` result file), then ``plan.rate``,
    ``plan.num_requests``, ``plan.input_len`` and ``plan.output_len`` where set."""
    from llmkit.tools.schema import BenchConfig, SloConfig

    plan = cfg.plan
    bench = cfg.bench.model_dump()
    update: dict[str, Any] = {}
    if plan.trace:
        allowed = "a bench serve or llmkit sim result JSON (with config.bench) that exists"
        try:
            doc = json.loads(Path(plan.trace).expanduser().read_text())
            traced = doc["config"]["bench"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError("plan.trace", plan.trace, allowed) from None
        bench.update({k: traced[k] for k in WORKLOAD_KEYS if k in traced})
        slo = doc["config"].get("slo")
        if slo and not any(_key(o).startswith("slo.") for o in overrides):
            update["slo"] = SloConfig.model_validate(slo)
    bench.update({k: getattr(plan, k) for k in SHORT_WORKLOAD_KEYS
                  if getattr(plan, k) is not None})
    update["bench"] = BenchConfig.model_validate(bench)
    return cfg.model_copy(update=update)


def without_unserved_slo(space: SearchSpace, slo: Any) -> SearchSpace:
    """``space`` less its ``scheduler=slo`` candidates when no objective is set for it to serve
    to (counted among the left-out combinations, with the reason)."""
    from llmkit.tools.plan.space import SearchSpace

    if slo.ttft_ms is not None or slo.tpot_ms is not None:
        return space
    kept = [c for c in space.candidates if c.scheduler != "slo"]
    dropped = len(space.candidates) - len(kept)
    if not dropped or not kept:
        return space
    skipped = {**space.skipped, "scheduler=slo without slo.ttft_ms / slo.tpot_ms": dropped}
    varied = [k for k in space.varied if len({getattr(c, k) for c in kept}) > 1]
    return SearchSpace(kept, varied, skipped)


def _describe_workload(b: Any) -> str:
    spread = f" (+-{100 * b.range_ratio:.0f}%)" if b.range_ratio else ""
    what = (f"{b.dataset_path}" if b.dataset == "jsonl" else
            f"{b.input_len} tokens in / {b.output_len} out{spread}")
    return (f"{b.num_requests} requests, {b.dataset} {what}, {b.arrival} arrivals at "
            f"{b.rate} req/s, seed {b.seed}")


def _describe_slo(slo: Any) -> str:
    parts = [f"{name} <= {v:g} ms" for name, v in
             (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2EL", slo.e2el_ms)) if v]
    return ", ".join(parts) or "none (goodput = request throughput)"


def _recalibrate(cfg: Any, ctx: Any, ranked: list, measured: dict[int, dict[str, Any]],
                 compose: Callable[[Any], Any], out_dir: Path, log: Callable[[str], None]
                 ) -> list[str]:
    """A verified candidate off its prediction by more than ``plan.recalibrate_error``: refit
    the profile's front-end term to its served trace and predict the verified ones again
    (``llmkit.tools.plan.recalibrate``); the lines for the recipe's comments."""
    from llmkit.tools.plan.recalibrate import off_by, recalibrate_from_trace, worst_miss
    from llmkit.tools.plan.runner import simulate
    from llmkit.tools.sim.source import resolve_sim_dtype

    worst = worst_miss({i: ranked[i].goodput for i in measured},
                       {i: m["goodput"] for i, m in measured.items()},
                       cfg.plan.recalibrate_error)
    if worst is None or ctx.cpu_cores is None:  # within it, or a profile of other hardware
        return []
    trace = out_dir / "verify" / f"candidate-{worst + 1}-trace.json"
    if not trace.is_file():
        log(f"candidate-{worst + 1} is off its prediction, but its server wrote no step trace "
            f"({trace}): not recalibrated")
        return []
    shape = ctx.model.shape
    dtype = resolve_sim_dtype(cfg, shape, ctx.hardware)
    try:
        recal = recalibrate_from_trace(trace, shape, ctx.hardware, dtype, out_dir)
    except ConfigError as e:
        log(f"not recalibrated from {trace}: {e}")
        return []
    log(recal.note())
    again = dataclasses.replace(ctx, hardware=recal.hardware)
    notes = [recal.note() + "; predicted again with it:"]
    for i in sorted(measured):
        pred = simulate(compose(ranked[i].candidate), ranked[i].candidate, again)
        got = measured[i]["goodput"]
        if pred.error:
            line = f"  verified #{i + 1}: {pred.error}"
        else:
            err = off_by(pred.goodput, got)
            line = (f"  verified #{i + 1}: predicted {pred.goodput:.3f} vs measured "
                    f"{got:.3f} req/s ({100 * (pred.goodput / got - 1) if got else 0:+.0f}%"
                    f"{'' if err <= cfg.plan.recalibrate_error else ': still NOT within'})")
        log(line.strip())
        notes.append(line)
    if any("still NOT" in n for n in notes):
        notes.append("  what the front end's share does not explain (a cold start, a "
                     "neighbour's load, a step shape the profile prices wrong) is still a miss")
    return notes


def run_plan_command(args: Any, load_config: Callable[..., Any], out: Any = None,
                     err: Any = None) -> int:
    """Run ``llmkit plan``: search, rank, verify, write (see the package's docstring)."""
    from llmkit.tools.plan.profile_check import ensure_profile
    from llmkit.tools.plan.rank import rank, rank_measured
    from llmkit.tools.plan.recipe import (agreement_line, figures_line, verified_line,
                                          write_recipe)
    from llmkit.tools.plan.report import format_table, plot_plan
    from llmkit.tools.plan.runner import SimContext, run_search
    from llmkit.tools.plan.space import build_space, usable_cores
    from llmkit.tools.plan.verify import VerifyError, measure

    out = out or sys.stdout
    err = err or sys.stderr

    def log(line: str) -> None:
        print(line, file=err, flush=True)

    if args.multirun:
        raise PlanError("-m (multirun) does not apply to plan: list the values to search in "
                        "plan.* (plan.max_num_seqs=[4,8,16])")
    from llmkit.tools.sim.cli import model_overrides

    # a named shape or a config.json is simulated (sim.model) but cannot be served
    overrides = model_overrides(args) + list(args.overrides)
    if any(_key(o) == "recipe" for o in overrides):
        raise PlanError("plan writes a recipe: give engine keys on the command line rather "
                        "than recipe=")
    if not any(_key(o) == "hardware" for o in overrides):
        overrides.insert(0, "hardware=cpu-local")
    cfg = apply_workload(load_config(args, overrides, tool=PlanToolConfig), overrides)
    plan = cfg.plan
    cores = plan.cores or usable_cores()
    space = without_unserved_slo(build_space(plan, cores), cfg.slo)
    # engine keys of the command line: for every candidate, the calibration and the servers
    searched = {_key(o) for o in space.candidates[0].overrides()} | {
        "speculative.num_speculative_tokens", "scheduler.slo_admission", "scheduler.slo_tpot"}
    engine_overrides = [o for o in overrides
                        if _key(o).partition(".")[0] not in TOOL_SECTIONS
                        and _key(o) not in searched]
    profile_notes = ensure_profile(cfg, args.model, engine_overrides, log)
    model_name = (cfg.sim.model or args.model or cfg.engine.model.path
                  or cfg.engine.model.name)
    try:
        ctx = SimContext.build(cfg, cores)
    except FileNotFoundError as e:
        raise PlanError(str(e)) from None
    skipped = "".join(f"; left out {n}: {why}" for why, n in space.skipped.items())
    log(f"plan: {len(space.candidates)} candidates of {model_name} on {ctx.hardware.name} "
        f"({cores} cores){skipped}")
    log(f"  workload: {_describe_workload(cfg.bench)}; SLO: {_describe_slo(cfg.slo)}")

    # the SLO planned for (perhaps plan.trace's) is the engine's too: scheduler=slo serves to it
    slo_overrides = [f"slo.{k}={'null' if v is None else v}"
                     for k, v in cfg.slo.model_dump().items()]

    def compose(cand: Any) -> PlanToolConfig:
        return load_config(args, overrides + cand.overrides() + slo_overrides,
                           tool=PlanToolConfig).model_copy(update={"bench": cfg.bench})

    preds = run_search(space.candidates, compose, ctx, log)
    ranked = rank(preds)
    ok = [p for p in ranked if not p.error]
    if not ok:
        raise PlanError(f"no candidate could be simulated; the first: {ranked[0].error}")
    out_dir = Path(plan.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(model=model_name, hardware=ctx.hardware.name,
                  workload=_describe_workload(cfg.bench), slo=_describe_slo(cfg.slo),
                  objectives=cfg.slo.model_dump(),
                  extra_overrides=[o for o in engine_overrides
                                   if not _key(o).startswith("slo.")])
    measured: dict[int, dict[str, Any]] = {}
    verify_top = plan.verify_top
    if verify_top and cfg.sim.model is not None:
        log(f"note: {cfg.sim.model} is a model shape (no weights): nothing to verify on the "
            "real engine (plan.verify_top ignored)")
        verify_top = 0
    for i in range(min(verify_top, len(ok))):
        name = f"candidate-{i + 1}"
        path = write_recipe(out_dir / "verify" / f"{name}.yaml", ranked[i].candidate,
                            predicted=ranked[i].summary, **common)
        try:
            result = measure(cfg, path.resolve(), model=args.model,
                             overrides=engine_overrides, out_dir=out_dir / "verify", name=name,
                             log=log, trace=(out_dir / "verify" / f"{name}-trace.json"
                                             ).resolve())
        except VerifyError as e:
            raise PlanError(str(e), code=1) from None
        measured[i] = result["summary"]
        log(f"{name}: measured {figures_line(result['summary'])}")
    recal_notes = _recalibrate(cfg, ctx, ranked, measured, compose, out_dir, log)
    # the verified ones by what was measured (goodput, then cost): the recipe is the best
    by_measure = rank_measured(ranked, measured)
    chosen = by_measure[0] if by_measure else 0
    best = ranked[chosen]
    verified = [verified_line(i + 1, ranked[i].candidate, ranked[i].summary, measured[i])
                for i in by_measure]
    recipe_path = Path(plan.output) if plan.output else out_dir / "recipe.yaml"
    notes = profile_notes + (["verified, best measured first (predicted vs measured):"]
                             + [f"  {v}" for v in verified] if verified else []) + recal_notes
    recipe = write_recipe(recipe_path, best.candidate, predicted=best.summary,
                          measured=measured.get(chosen), notes=notes, **common)
    knobs = space.varied
    table = format_table(ranked, knobs, measured)
    (out_dir / "table.txt").write_text(table + "\n")
    png = plot_plan(ranked, knobs, out_dir / "plan.png", measured)
    doc = {"model": model_name, "hardware": ctx.hardware.name, "cores": cores,
           "workload": cfg.bench.model_dump(mode="json"), "slo": cfg.slo.model_dump(mode="json"),
           "candidates": [{"rank": i + 1, **p.candidate.values(), "error": p.error,
                           "tokens_per_core_s": p.tokens_per_core_s, "predicted": p.summary,
                           "measured": measured.get(i)} for i, p in enumerate(ranked)],
           "chosen": chosen + 1, "verified_order": [i + 1 for i in by_measure],
           "profile": profile_notes}
    (out_dir / "plan.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table, file=out)
    if len(verified) > 1:
        print("verified, best measured first:", file=out)
        for v in verified:
            print(f"  {v}", file=out)
    why = " (the best measured)" if len(verified) > 1 else ""
    print(f"chosen: #{chosen + 1}{why} {best.candidate.label()}", file=out)
    print(f"  predicted: {figures_line(best.summary)}", file=out)
    if chosen in measured:
        print(f"  measured:  {figures_line(measured[chosen])}", file=out)
        print(f"  {agreement_line(best.goodput, measured[chosen]['goodput'])}", file=out)
    else:
        print("  measured: not verified", file=out)
    print(f"wrote {recipe} (llmkit serve {model_name} recipe={recipe}), "
          f"{out_dir / 'table.txt'}, {out_dir / 'plan.json'}"
          + (f", {png}" if png else ""), file=out)
    return 0
