"""This machine's hardware profile for ``llmkit plan`` (``hardware=cpu-local``): calibrated
first when there is none, and checked when there is one.

A cached profile (``llmkit sim calibrate engine``'s, ``<llmkit cache>/hardware/cpu-local.yaml``)
describes the machine and engine build it was measured on; a VM moved to other hardware, a
busy neighbour during the calibration or a faster engine build make its predictions wrong, and
a plan on it ranks the candidates for a machine that is not this one. So before the search the
plan times a few steps of the real engine now (``CHECK_SHAPES``: two prefills and two decode
batches, a subset of the calibration's shapes, once the model is loaded) and compares them
with what the profile expects of the same steps: the times its calibration measured for them
(``engine_steps_ms``, which ``llmkit sim calibrate engine`` writes), else, for a profile without
them, what its cost model predicts (``CostModel.step``). (The measured times, because a fresh
profile's fit can be far off on a few shapes while right on average: compared with the fit, a
profile just calibrated could read as stale.) Off by more than ``plan.max_profile_error``
(expected / measured - 1 of the median shape, the sign of ``agreement_line``'s), the profile is
stale: ``plan.stale_profile`` says whether to calibrate again (in a child process, as a missing
profile is), to stop with the command to run, or to plan on it with a warning. What was decided
goes to the progress output and into the recipe's comments (``notes``).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from llmkit.tools.plan.errors import PlanError
from llmkit.tools.sim.engine_measure import DECODE_STEPS, PREFILL_REPS

__all__ = ["CHECK_SHAPES", "ProfileCheck", "check_profile", "ensure_profile", "measure_check"]

# the steps the check times: a short prompt and one as long as a serving workload's, decode
# alone and in a batch; measure_engine's phases as the calibration runs them (the same labels,
# repetitions and decode steps), so that the profile's engine_steps_ms has each of them
CHECK_SHAPES: dict[str, Any] = dict(prefill_lens=(64, 256), decode_batches=(1, 4),
                                    decode_contexts=(128,), decode_steps=DECODE_STEPS,
                                    prefill_reps=PREFILL_REPS, mixed=False, budget_s=60.0)

Log = Callable[[str], None]


@dataclass
class ProfileCheck:
    """The check's steps (``groups``: ``StepGroup``, measured now) and what the profile
    expects of each (``predicted_s``: the calibration's time of the shape, or the cost model's
    prediction: ``basis``)."""

    path: Path
    groups: list[Any]
    predicted_s: list[float]
    tolerance: float
    basis: str = "its cost model"
    timed: int = 0  # shapes timed now (``groups``: those compared)

    @property
    def error(self) -> float:
        """expected / measured - 1 of the median shape (each shape counts once, so a long
        prefill does not outweigh the decode steps serving is made of; the median, so that a
        neighbour's burst of CPU use during one shape's few steps does not decide)."""
        logs = sorted(math.log(p / g.seconds) for p, g in zip(self.predicted_s, self.groups)
                      if p > 0 and g.seconds > 0)
        if not logs:
            return 0.0
        mid = len(logs) // 2
        return math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2) - 1.0

    @property
    def stale(self) -> bool:
        return abs(self.error) > self.tolerance

    def summary(self) -> str:
        verdict = "is stale" if self.stale else "holds"
        way = "slower" if self.error > 0 else "faster"
        return (f"the profile ({self.basis}) expects this machine's steps "
                f"{100 * abs(self.error):.0f}% {way} than they run now (the median of "
                f"{len(self.groups)} step shapes; plan.max_profile_error={self.tolerance:g}): "
                f"it {verdict}")

    def lines(self) -> list[str]:
        return [f"{g.label:<20} n={g.num_seqs:<2} T={g.num_tokens:<4}: now "
                f"{1e3 * g.seconds:7.2f} ms, profile {1e3 * p:7.2f} ms "
                f"({100 * (p / g.seconds - 1):+.0f}%)"
                for g, p in zip(self.groups, self.predicted_s)]


def measure_check(cfg: Any) -> Any:
    """The check's timed steps of ``cfg``'s real engine (an ``EngineMeasurement``; the step
    graphs waited for, as calibrating does: a cold compile cache costs the wait once, the
    graphs are saved for every later start)."""
    from llmkit.tools.sim.engine_measure import measure_engine

    return measure_engine(cfg, **CHECK_SHAPES)  # (the engine core sets its threads)


def check_profile(cfg: Any, path: Path, *, tolerance: float,
                  measure: Callable[[Any], Any] | None = None) -> ProfileCheck:
    """Time ``CHECK_SHAPES`` on ``cfg``'s engine (``measure``: ``measure_check``) and compare
    them with the profile at ``path``: with the times its calibration measured for the shapes
    it has (``engine_steps_ms``; at least two of them), else with its cost model's prediction."""
    from llmkit.cost_model.hardware import load_profile, load_profile_yaml
    from llmkit.cost_model.step_cost import CostModel
    from llmkit.tools.sim.engine_fit import group_samples

    profile = load_profile(path)  # validated: a bad file fails here, naming the key
    meas = (measure or measure_check)(cfg)
    groups = group_samples(meas.samples)
    if not groups:
        raise ValueError("the profile check timed no engine steps")
    timed = load_profile_yaml(path).get("engine_steps_ms") or {}
    known = [g for g in groups if g.key in timed]
    if len(known) >= 2:
        return ProfileCheck(path, known, [timed[g.key] / 1e3 for g in known], tolerance,
                            basis="the steps timed when it was calibrated", timed=len(groups))
    model = CostModel(meas.shape, profile, meas.dtype)
    return ProfileCheck(path, groups, [model.step(g.work).total_s for g in groups], tolerance,
                        timed=len(groups))


def _calibrate(cfg: Any, path: Path, model: str | None, engine_overrides: Sequence[str],
               log: Log) -> None:
    """``llmkit sim calibrate`` for the model, in a child process (the engine it times leaves
    nothing behind in this one), its lines relayed to ``log``."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.75 * (cfg.plan.cores or os.cpu_count() or 1):
        log(f"warning: the machine is busy (load average {load:.1f}): the profile will be "
            "slower than this machine is alone, and so will the predictions")
    cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "sim", "calibrate",
           model or "engine", f"sim.calibrate_output={path}", *engine_overrides]
    trace = cfg.sim.calibrate_trace
    if trace:
        cmd.append(f"sim.calibrate_trace={Path(trace).expanduser().resolve()}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        log("  " + line.rstrip())
    rc = proc.wait()
    if not path.is_file():
        raise PlanError(f"llmkit sim calibrate failed (exit {rc}) and wrote no profile: "
                    f"{' '.join(cmd[3:])}", 1)
    if rc != 0:
        log(f"warning: llmkit sim calibrate exited with {rc} after writing {path}")


def _check(cfg: Any, path: Path, model: str | None, engine_overrides: Sequence[str],
           log: Log, measure: Callable[[Any], Any] | None) -> list[str]:
    """The check of an existing profile and what follows from it; the recipe's notes."""
    plan = cfg.plan
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.75 * (plan.cores or os.cpu_count() or 1):
        log(f"warning: the machine is busy (load average {load:.1f}): the steps timed now will "
            "be slower than this machine is alone, and the check may call the profile stale")
    log(f"checking the profile on this machine now: {len(CHECK_SHAPES['prefill_lens'])} "
        f"prefills and {len(CHECK_SHAPES['decode_batches'])} decode batches of the real engine "
        "(plan.max_profile_error=null skips it)")
    try:
        result = check_profile(cfg, path, tolerance=plan.max_profile_error, measure=measure)
    except (RuntimeError, ValueError, OSError) as e:
        log(f"warning: the profile check could not run ({type(e).__name__}: {e}); planning on "
            "the profile as it is")
        return [f"hardware profile {path}: not checked ({type(e).__name__})"]
    for line in result.lines():
        log("  " + line)
    log(result.summary())
    found = f"hardware profile {path}: {result.summary()}"
    if not result.stale:
        return [found + ", kept"]
    command = f"llmkit sim calibrate {model or 'engine'}"
    if plan.stale_profile == "refuse":
        raise PlanError(f"the hardware profile {path} is stale: {result.summary()}; run "
                        f"`{command}` to measure this machine again (or plan.stale_profile="
                        "recalibrate to let plan run it, plan.stale_profile=warn to plan on it "
                        "anyway)")
    if plan.stale_profile == "warn" or not plan.calibrate:
        why = "plan.stale_profile=warn" if plan.calibrate else "plan.calibrate=false"
        log(f"warning: {why}: planning on the stale profile; the predictions will be off "
            f"(`{command}` measures this machine again)")
        return [found + f", used anyway ({why})"]
    log(f"the profile is stale: running `{command}` again (plan.stale_profile=recalibrate)")
    _calibrate(cfg, path, model, engine_overrides, log)
    return [found + f", so recalibrated now (`{command}`)"]


def ensure_profile(cfg: Any, model: str | None, engine_overrides: Sequence[str], log: Log,
                   *, measure: Callable[[Any], Any] | None = None) -> list[str]:
    """``hardware=cpu-local``: calibrate when there is no profile (or with
    ``sim.calibrate_trace``: again, so that the profile prices the front end's share of the
    cores as the server will), else check the profile (see the module's docstring). Returns
    the lines the recipe carries about it."""
    from llmkit.cost_model.hardware import CALIBRATED_NAME, default_calibration_path

    if cfg.hardware is None or cfg.hardware.name != CALIBRATED_NAME:
        return []
    out = cfg.sim.calibrate_output
    path = Path(out).expanduser() if out else default_calibration_path()
    trace = cfg.sim.calibrate_trace
    if path.is_file() and not trace:
        log(f"hardware: this machine's calibrated profile {path}")
        if cfg.plan.max_profile_error is None:
            return [f"hardware profile {path}: not checked (plan.max_profile_error=null)"]
        if cfg.sim.model is not None:
            log(f"note: {cfg.sim.model} is a model shape (no weights): the profile is not "
                "checked")
            return []
        return _check(cfg, path, model, engine_overrides, log, measure)
    if not cfg.plan.calibrate:
        if path.is_file():
            log(f"warning: plan.calibrate=false: sim.calibrate_trace={trace} is not used; "
                f"planning on the profile {path} as it is")
        else:
            log(f"warning: no calibrated profile for this machine ({path}) and plan.calibrate="
                "false: planning on the shipped placeholder figures")
        return []
    if trace:
        log(f"calibrating this machine with the served trace {trace}: running `llmkit sim "
            f"calibrate engine sim.calibrate_trace=...` first (cached in {path})")
    else:
        log(f"no calibrated profile for this machine ({path}): running `llmkit sim calibrate "
            "engine` first (cached there for later plans)")
    _calibrate(cfg, path, model, engine_overrides, log)
    return [f"hardware profile {path}: calibrated now"]
