"""`llmkit plan` refits its profile's front-end term from a verification server's step trace
when a verified candidate measured more than plan.recalibrate_error off its prediction, and
predicts the verified candidates again with it. Deterministic: a synthetic trace whose steps
took 1 / (1 - c·R) of what the engine-alone profile prices them at, and a fake simulator."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmkit.cost_model.hardware import HardwareProfile, load_profile
from llmkit.cost_model.model_shape import ModelShape
from llmkit.cost_model.step_cost import CostModel
from llmkit.tools.plan import cli as plan_cli
from llmkit.tools.plan import recalibrate
from llmkit.tools.plan.runner import Prediction

from helpers.served_trace import smol_shape, write_served_trace

C = 1.5e-3  # the front end's engine seconds per token streamed, in the synthetic trace


def _profile(tmp_path: Path) -> HardwareProfile:
    """An engine-alone profile, from a file (the refit copies it)."""
    path = tmp_path / "cpu-local.yaml"
    path.write_text("name: cpu-local\npeak_tflops:\n  float32: 0.15\nmemory_gb: 16\n"
                    "memory_bandwidth_gbs: 25.6\nefficiency:\n  compute: 1.0\n  memory: 1.0\n"
                    "seq_overhead_us: 1000\ntoken_overhead_us: 1000\n"
                    "frontend_token_us: 0   # not measured\n")
    return load_profile(path)


def _served_trace(path: Path, shape: ModelShape, hw: HardwareProfile) -> Path:
    served = CostModel(shape, HardwareProfile(**{**hw.as_dict(), "frontend_token_s": C}),
                       "float32")
    write_served_trace(path, served, [(0, 0, 0, 8, 8, 8 * 200), (1, 128, 128, 3, 3, 3 * 150),
                                      (2, 64, 600, 0, 0, 0), (0, 0, 0, 24, 24, 24 * 170)] * 6)
    return path


def test_off_by_and_the_worst_miss():
    assert recalibrate.off_by(0.872, 0.872) == 0
    assert recalibrate.off_by(0.872, 0.278) == pytest.approx(2.137, abs=1e-3)
    assert recalibrate.off_by(0.5, 0.0) == float("inf")
    pred, meas = {0: 0.872, 1: 0.872}, {0: 0.278, 1: 0.870}
    assert recalibrate.worst_miss(pred, meas, 0.2) == 0
    assert recalibrate.worst_miss(pred, {0: 0.8, 1: 0.870}, 0.2) is None  # +9%: within
    assert recalibrate.worst_miss(pred, meas, None) is None


def test_the_front_end_term_is_fitted_from_the_served_trace(tmp_path):
    shape, hw = smol_shape(), _profile(tmp_path)
    trace = _served_trace(tmp_path / "served.json", shape, hw)
    out = tmp_path / "out"
    out.mkdir()
    recal = recalibrate.recalibrate_from_trace(trace, shape, hw, "float32", out)
    assert recal.hardware.frontend_token_s == pytest.approx(C, rel=1e-6)
    assert hw.frontend_token_s == 0  # the profile in use is not changed
    written = load_profile(recal.path)
    assert written.frontend_token_s == pytest.approx(C, rel=1e-5)
    assert written.seq_overhead_s == hw.seq_overhead_s  # the rest copied as it was
    assert "frontend_token_us=1500" in recal.note()


def _run(tmp_path: Path, measured_goodput: float):
    """plan's _recalibrate on one verified candidate predicted at 1.0 req/s; the fake
    simulator predicts less the more the profile charges the front end."""
    shape, hw = smol_shape(), _profile(tmp_path)
    out = tmp_path / f"plan-{measured_goodput}"
    (out / "verify").mkdir(parents=True)
    _served_trace(out / "verify" / "candidate-1-trace.json", shape, hw)
    cand = SimpleNamespace(label=lambda: "c1")
    ranked = [Prediction(cand, summary={"goodput": 1.0})]
    seen = []

    def simulate(cfg, cand, ctx):
        seen.append(ctx.hardware.frontend_token_s)
        return Prediction(cand, summary={"goodput": 1.0 - 100 * ctx.hardware.frontend_token_s})

    import llmkit.tools.plan.runner as runner
    cfg = SimpleNamespace(plan=SimpleNamespace(recalibrate_error=0.2),
                          sim=SimpleNamespace(dtype="float32"))
    ctx = runner.SimContext(model=SimpleNamespace(shape=shape), hardware=hw, workload=[],
                            cpu_cores=2)
    logs: list[str] = []
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "simulate", simulate)
    try:
        notes = plan_cli._recalibrate(cfg, ctx, ranked, {0: {"goodput": measured_goodput}},
                                      lambda c: cfg, out, logs.append)
    finally:
        mp.undo()
    return notes, seen, out


def test_a_miss_refits_and_predicts_the_verified_candidates_again(tmp_path):
    notes, seen, out = _run(tmp_path, 0.85)  # +18%: within 20%, nothing to do
    assert notes == [] and seen == []
    notes, seen, out = _run(tmp_path, 0.6)  # +67%: refit
    assert seen == [pytest.approx(C, rel=1e-6)]
    assert notes[0].startswith("recalibrated from the served trace")
    assert notes[1] == "  verified #1: predicted 0.850 vs measured 0.600 req/s (+42%: still " \
                       "NOT within)"
    assert (out / "hardware-recalibrated.yaml").is_file()
