"""``llmkit plan`` checks a cached hardware profile against timed steps of the engine before it
searches (``llmkit.tools.plan.profile_check``): a profile that predicts this machine's steps
within ``plan.max_profile_error`` is kept; a stale one (a doctored profile here, predicting
2-3x slower steps than the ones timed) is recalibrated, refused with the command to run, or
used with a warning, and the recipe says which. The timed steps are fake here (the profile's
own prediction, scaled: deterministic), except in one test that times the real tiny engine.

And when it verifies several candidates, the recipe is the best *measured* one (goodput, then
cost), its comments carry predicted vs measured for each verified candidate."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from llmkit.cost_model.hardware import load_profile
from llmkit.cost_model.model_shape import load_shape
from llmkit.cost_model.step_cost import CostModel
from llmkit.entrypoints import cli
from llmkit.tools.plan import profile_check
from llmkit.tools.plan.rank import rank_measured
from llmkit.tools.plan.runner import Prediction
from llmkit.tools.plan.space import Candidate
from llmkit.tools.sim.engine_measure import EngineMeasurement, StepSample

REPO = Path(__file__).resolve().parents[1]
PLACEHOLDER = REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml"
TINY = ["plan.verify_top=0", "plan.max_num_seqs=[2]", "plan.max_num_batched_tokens=[64]",
        "plan.speculative=[none]", "bench.num_requests=3", "bench.input_len=16",
        "bench.output_len=4", "kv_cache.num_blocks=64"]
# the check's step shapes: (new tokens, context after the step, samples) per request
STEPS = {"prefill 64": [(64, 64, True)], "prefill 256": [(256, 256, True)],
         "decode b=1 ctx=128": [(1, 130, True)], "decode b=4 ctx=128": [(1, 130, True)] * 4}


def fake_timer(model_dir: Path, truth: Path, scale: float = 1.0):
    """A ``measure_check`` whose steps take what the profile ``truth`` predicts, x ``scale``."""
    shape = load_shape(str(model_dir))
    model = CostModel(shape, load_profile(truth), "float32")
    calls = []

    def measure(cfg):
        calls.append(cfg)
        samples = [StepSample(label, work, scale * model.step(work).total_s)
                   for label, work in STEPS.items() for _ in range(3)]
        return EngineMeasurement(model_name="tiny", shape=shape, dtype="float32",
                                 samples=samples, load_s=0.0, measure_s=0.0, threads=1,
                                 attention="fake")
    measure.calls = calls
    return measure


def doctored(path: Path, slower: float) -> Path:
    """The placeholder profile made ``slower`` times slower everywhere: as one calibrated on a
    slower machine."""
    d = yaml.safe_load(PLACEHOLDER.read_text())
    d["peak_tflops"] = {k: v / slower for k, v in d["peak_tflops"].items()}
    d["memory_bandwidth_gbs"] /= slower
    for k in ("step_overhead_ms", "layer_overhead_us", "seq_overhead_us", "token_overhead_us",
              "context_overhead_ns"):
        if d.get(k):
            d[k] *= slower
    path.write_text(yaml.safe_dump(d))
    return path


class FakeCalibrate:
    """`llmkit sim calibrate MODEL ...` as a child: records the command, writes the profile."""

    calls: list[list[str]] = []

    def __init__(self, cmd, **kw):
        FakeCalibrate.calls.append(cmd)
        out = next(a for a in cmd if a.startswith("sim.calibrate_output="))
        shutil.copy(PLACEHOLDER, out.partition("=")[2])
        self.stdout = iter(["fit over 9 step shapes\n"])

    def wait(self):
        return 0


@pytest.fixture
def fake_calibrate(monkeypatch):
    FakeCalibrate.calls = []
    monkeypatch.setattr(subprocess, "Popen", FakeCalibrate)
    return FakeCalibrate.calls


def test_the_check_compares_the_profile_with_the_steps_timed(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    truth = tmp_path / "truth.yaml"
    shutil.copy(PLACEHOLDER, truth)
    cfg = object()
    # steps 10% slower than the profile predicts: -9%, within 20%
    res = profile_check.check_profile(cfg, truth, tolerance=0.2,
                                      measure=fake_timer(model, truth, 1.1))
    assert len(res.groups) == 4 and res.error == pytest.approx(1 / 1.1 - 1)
    assert not res.stale and "holds" in res.summary()
    # a profile of a machine 2.5x slower: +150%, stale; and the sign says which way
    slow = doctored(tmp_path / "slow.yaml", 2.5)
    res = profile_check.check_profile(cfg, slow, tolerance=0.2,
                                      measure=fake_timer(model, truth))
    assert res.error == pytest.approx(1.5, rel=0.02) and res.stale
    fast = doctored(tmp_path / "fast.yaml", 0.5)
    res = profile_check.check_profile(cfg, fast, tolerance=0.2,
                                      measure=fake_timer(model, truth))
    assert res.error == pytest.approx(-0.5, rel=0.02) and res.stale
    # the median shape decides: one shape timed 3x slower (a neighbour's burst) does not
    noisy = fake_timer(model, truth, 1.1)

    def burst(cfg):
        m = noisy(cfg)
        m.samples = [StepSample(s.phase, s.work, s.seconds * (3 if s.phase == "prefill 64"
                                                              else 1)) for s in m.samples]
        return m
    res = profile_check.check_profile(cfg, truth, tolerance=0.2, measure=burst)
    assert res.error == pytest.approx(1 / 1.1 - 1) and not res.stale
    assert "expects this machine's steps 9% faster than they run now" in res.summary()
    # the tolerance is the key's: 2x off passes a tolerance of 2
    assert not profile_check.check_profile(cfg, slow, tolerance=2.0,
                                           measure=fake_timer(model, truth)).stale


def test_the_steps_timed_at_calibration_are_the_reference_where_the_profile_has_them(
        tiny_model_dir, tmp_path):
    """A profile whose fit is 2.5x off on these shapes, but whose calibration timed them as
    they take now, holds (a fresh profile is not stale for its fit's error); one whose
    calibration timed them 2x slower is stale, whatever its fit."""
    model = tiny_model_dir("llama")
    truth = tmp_path / "truth.yaml"
    shutil.copy(PLACEHOLDER, truth)
    timer = fake_timer(model, truth)
    times = {f"{label} n={len(work)} T={sum(q for q, _, _ in work)}": 1e3 * s
             for label, work, s in ((smp.phase, smp.work, smp.seconds)
                                    for smp in timer(None).samples)}
    profile = doctored(tmp_path / "fit-off.yaml", 2.5)
    d = yaml.safe_load(profile.read_text())
    d["engine_steps_ms"] = {k: 1.05 * v for k, v in times.items()}
    profile.write_text(yaml.safe_dump(d))
    res = profile_check.check_profile(None, profile, tolerance=0.2, measure=timer)
    assert res.basis == "the steps timed when it was calibrated" and len(res.groups) == 4
    assert res.error == pytest.approx(0.05) and not res.stale
    d["engine_steps_ms"] = {k: 2 * v for k, v in times.items()}
    profile.write_text(yaml.safe_dump(d))
    res = profile_check.check_profile(None, profile, tolerance=0.2, measure=timer)
    assert res.error == pytest.approx(1.0) and res.stale
    # a bad profile fails naming the key
    d["engine_steps_ms"] = {"prefill 64 n=1 T=64": "fast"}
    profile.write_text(yaml.safe_dump(d))
    with pytest.raises(Exception, match="engine_steps_ms"):
        profile_check.check_profile(None, profile, tolerance=0.2, measure=timer)


def test_a_fresh_profile_is_kept(tiny_model_dir, tmp_path, monkeypatch, fake_calibrate,
                                 capsys):
    model = tiny_model_dir("llama")
    profile = tmp_path / "cpu-local.yaml"
    shutil.copy(PLACEHOLDER, profile)
    timer = fake_timer(model, profile, 1.05)
    monkeypatch.setattr(profile_check, "measure_check", timer)
    out = tmp_path / "plan"
    assert cli.main(["plan", str(model), f"sim.calibrate_output={profile}", *TINY,
                     f"plan.output_dir={out}"]) == 0
    err = capsys.readouterr().err
    assert len(timer.calls) == 1 and fake_calibrate == []
    assert "checking the profile on this machine now" in err and "it holds" in err
    assert f"# hardware profile {profile}: the profile (its cost model) expects" in \
        (out / "recipe.yaml").read_text()
    assert ", kept" in (out / "recipe.yaml").read_text()
    # plan.max_profile_error=null: no check
    assert cli.main(["plan", str(model), f"sim.calibrate_output={profile}", *TINY,
                     "plan.max_profile_error=null", f"plan.output_dir={out}"]) == 0
    assert len(timer.calls) == 1 and "not checked" in (out / "recipe.yaml").read_text()


def test_a_stale_profile_is_recalibrated_refused_or_used_with_a_warning(
        tiny_model_dir, tmp_path, monkeypatch, fake_calibrate, capsys):
    model = tiny_model_dir("llama")
    truth = tmp_path / "truth.yaml"
    shutil.copy(PLACEHOLDER, truth)
    monkeypatch.setattr(profile_check, "measure_check", fake_timer(model, truth))
    profile = tmp_path / "cpu-local.yaml"
    out = tmp_path / "plan"
    argv = ["plan", str(model), f"sim.calibrate_output={profile}", *TINY,
            f"plan.output_dir={out}"]

    # refuse: stops before the search, naming the command and the keys
    doctored(profile, 2.0)
    assert cli.main([*argv, "plan.stale_profile=refuse"]) == 2
    err = capsys.readouterr().err
    assert "is stale" in err and f"llmkit sim calibrate {model}" in err
    assert "plan.stale_profile=recalibrate" in err and "plan.max_profile_error=0.2" in err
    assert fake_calibrate == [] and not (out / "recipe.yaml").exists()

    # warn: plans on it, says so
    assert cli.main([*argv, "plan.stale_profile=warn"]) == 0
    err = capsys.readouterr().err
    assert "warning: plan.stale_profile=warn" in err and fake_calibrate == []
    assert "used anyway (plan.stale_profile=warn)" in (out / "recipe.yaml").read_text()

    # recalibrate (the default): `llmkit sim calibrate MODEL` in a child, the engine keys along
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len(fake_calibrate) == 1
    assert fake_calibrate[0][3:7] == ["sim", "calibrate", str(model),
                                      f"sim.calibrate_output={profile}"]
    assert "kv_cache.num_blocks=64" in fake_calibrate[0]
    assert "the profile is stale: running" in err and "  fit over 9" in err
    assert "so recalibrated now" in (out / "recipe.yaml").read_text()
    # ... plan.calibrate=false never calibrates: a warning instead
    doctored(profile, 2.0)
    assert cli.main([*argv, "plan.calibrate=false"]) == 0
    assert len(fake_calibrate) == 1 and "warning: plan.calibrate=false" in capsys.readouterr().err


def test_the_check_times_the_real_engine_as_the_calibration_did(tiny_model_dir, tmp_path):
    """The check's shapes on the real (tiny) engine: every one timed and priced by the shipped
    profile's cost model; and after `llmkit sim calibrate engine`, every one is among the steps
    the calibration timed (its engine_steps_ms), which are then the reference."""
    from llmkit.tools.compose import build_tool_config
    from llmkit.tools.schema import PlanToolConfig
    from llmkit.tools.sim.calibrate import run_engine_calibrate

    model = tiny_model_dir("llama")
    out = tmp_path / "calibrated.yaml"
    cfg = build_tool_config(PlanToolConfig, str(model), overrides=[
        "kv_cache.num_blocks=128", f"sim.calibrate_output={out}",
        "sim.calibrate_gemm_size=128", "sim.calibrate_buffer_mib=8"])
    res = profile_check.check_profile(cfg, PLACEHOLDER, tolerance=0.2)
    labels = {g.label for g in res.groups}
    assert {"prefill 64", "prefill 256", "decode b=1 ctx=128", "decode b=4 ctx=128"} <= labels
    assert res.basis == "its cost model"
    assert all(g.seconds > 0 for g in res.groups) and all(p > 0 for p in res.predicted_s)
    run_engine_calibrate(cfg)
    res = profile_check.check_profile(cfg, out, tolerance=0.2)
    timed = yaml.safe_load(out.read_text())["engine_steps_ms"]
    assert res.basis == "the steps timed when it was calibrated"
    assert len(res.groups) == res.timed >= 4 and all(g.key in timed for g in res.groups)


# --------------------------------------------------------------------------- verification

def _pred(goodput: float, i: int) -> Prediction:
    return Prediction(Candidate(max_num_seqs=2 ** (i + 1), max_num_batched_tokens=64), summary={
        "goodput": goodput, "duration_s": 10.0, "total_output_tokens": 100}, cores=2)


def _measured(goodput: float, tokens: int) -> dict:
    return {"goodput": goodput, "slo_attainment": goodput / 2, "output_throughput": tokens / 10,
            "duration_s": 10.0, "total_output_tokens": tokens, "completed": 4,
            "ttft_ms": {"mean": 100.0}, "tpot_ms": {"mean": 20.0}}


def test_verified_candidates_rank_by_measured_goodput_then_cost():
    ranked = [_pred(1.0, 0), _pred(0.5, 1), _pred(0.4, 2)]
    measured = {0: _measured(0.2, 500), 1: _measured(0.6, 100), 2: _measured(0.6, 300)}
    assert rank_measured(ranked, measured) == [2, 1, 0]
    measured[1] = _measured(0.6, 300)  # a tie on both: the predicted rank
    assert rank_measured(ranked, measured) == [1, 2, 0]


def test_the_recipe_is_the_best_measured_and_carries_each_verified(tiny_model_dir, tmp_path,
                                                                     monkeypatch, capsys):
    from llmkit.tools.plan import verify

    model = tiny_model_dir("llama")
    measured = iter([_measured(0.1, 40), _measured(0.3, 40)])
    names = []

    def fake_measure(cfg, recipe, *, name, **kw):
        names.append(name)
        return {"summary": next(measured)}

    monkeypatch.setattr(verify, "measure", fake_measure)
    profile = tmp_path / "cpu-local.yaml"
    shutil.copy(PLACEHOLDER, profile)
    out = tmp_path / "plan"
    assert cli.main(["plan", str(model), f"sim.calibrate_output={profile}", *TINY,
                     "plan.max_profile_error=null", "plan.verify_top=2",
                     "plan.max_num_seqs=[2,4]", f"plan.output_dir={out}"]) == 0
    io = capsys.readouterr()
    assert names == ["candidate-1", "candidate-2"]
    doc = yaml.safe_load((out / "plan.json").read_text())
    assert doc["chosen"] == 2 and doc["verified_order"] == [2, 1]
    second = doc["candidates"][1]
    text = (out / "recipe.yaml").read_text()
    recipe = yaml.safe_load(text)
    assert recipe["scheduler"]["max_num_seqs"] == second["max_num_seqs"]
    assert "chosen: #2 (the best measured)" in io.out
    lines = [ln for ln in text.splitlines() if ln.startswith("#   verified #")]
    assert [ln.split()[2] for ln in lines] == ["#2", "#1"]
    assert all("predicted vs measured goodput:" in ln for ln in lines)
    assert f"vs 0.300 req/s" in lines[0] and "vs 0.100 req/s" in lines[1]
    # the chosen one's agreement, within 20% or not, is said in the output and the recipe
    assert "predicted vs measured goodput:" in io.out.split("chosen:")[1]
    assert "# predicted vs measured goodput:" in text
