"""``llmkit plan`` learning from its own verification: when a verified candidate measured more
than ``plan.recalibrate_error`` off its prediction, the profile's front-end term is fitted to
that server's step trace and the verified candidates are predicted again with it.

The calibrated profile prices the engine alone; served on the same cores, its steps also pay
for the API server and the benchmark client streaming tokens (``frontend_token_us``,
``llmkit.tools.sim.frontend_cost``: a share ``c·R`` of the CPU at ``R`` tokens/s streamed). A
verification server records its steps (``observability.trace_file``), which is what
``llmkit sim calibrate engine sim.calibrate_trace=PATH`` fits that term to; here the fit runs on
the trace of the candidate that was furthest off, without timing anything again. The refitted
profile is written beside the results (``hardware-recalibrated.yaml``: the profile in use with
the fitted line) and the recipe's comments say what the new predictions are. What the front end
does not explain (a cold start, a neighbour's load) stays a miss, and the plan says so.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["Recalibration", "off_by", "recalibrate_from_trace", "worst_miss"]


def off_by(predicted: float, measured: float) -> float:
    """``|predicted / measured - 1|`` (infinite when nothing met the SLO but some was
    predicted to)."""
    if measured <= 0:
        return 0.0 if predicted <= 0 else float("inf")
    return abs(predicted / measured - 1.0)


def worst_miss(predicted: Mapping[int, float], measured: Mapping[int, float],
               limit: float | None) -> int | None:
    """The verified candidate (its index) furthest off its prediction, if more than
    ``limit``; None when every one is within it (or ``limit`` is None)."""
    if limit is None:
        return None
    errs = {i: off_by(predicted[i], measured[i]) for i in measured if i in predicted}
    if not errs:
        return None
    worst = max(errs, key=lambda i: errs[i])
    return worst if errs[worst] > limit else None


@dataclass
class Recalibration:
    hardware: Any  # the profile with the fitted front-end term
    fit: Any  # frontend_cost.FrontendFit
    path: Path | None  # the profile written (None: the profile had no file to copy)

    def note(self) -> str:
        f = self.fit
        return (f"recalibrated from the served trace {f.trace}: its {f.num_steps} steps took "
                f"{100 * f.excess:+.0f}% over the engine-alone model at {f.mean_rate:.0f} "
                f"tokens/s streamed, so frontend_token_us={f.token_s * 1e6:.0f}"
                + (f" ({self.path})" if self.path else ""))


def _profile_text(source: str | None, token_s: float, why: str) -> str | None:
    """The profile file ``source`` with its ``frontend_token_us`` line replaced (or added)."""
    if not source or not Path(source).is_file():
        return None
    text = Path(source).read_text()
    line = f"frontend_token_us: {token_s * 1e6:.6g}   # fitted by llmkit plan: {why}"
    pattern = re.compile(r"^frontend_token_us:.*$", re.M)
    if pattern.search(text):
        return pattern.sub(lambda _: line, text, count=1)
    return text.rstrip("\n") + "\n" + line + "\n"


def recalibrate_from_trace(trace: Path, shape: Any, hardware: Any, dtype: str,
                           out_dir: Path | None = None) -> Recalibration:
    """Fit ``hardware``'s front-end term to the served ``trace`` (``shape`` and ``dtype``: the
    simulated model's); write the refitted profile to ``out_dir`` when given."""
    from llmkit.tools.sim.frontend_cost import frontend_cost_from_trace

    fit = frontend_cost_from_trace(trace, shape, hardware, dtype)
    refit = dataclasses.replace(hardware, frontend_token_s=fit.token_s)
    path = None
    if out_dir is not None:
        text = _profile_text(getattr(hardware, "source_path", None), fit.token_s,
                             f"{fit.num_steps} served steps of {trace}")
        if text is not None:
            path = out_dir / "hardware-recalibrated.yaml"
            path.write_text(text)
    return Recalibration(refit, fit, path)

