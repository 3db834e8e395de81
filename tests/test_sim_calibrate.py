"""``llmkit sim calibrate``: this machine's figures as the ``cpu-local`` profile."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.entrypoints import cli
from llmkit.tools.compose import compose_tool_config
from llmkit.tools.schema import SimToolConfig
from llmkit.tools.sim.calibrate import profile_yaml

from helpers.served_trace import smol_shape, write_served_trace

REPO = Path(__file__).resolve().parents[1]


def test_calibrate_writes_cpu_local_and_hardware_cpu_local_reads_it(tmp_path, capsys):
    from llmkit.tools.sim.hardware import resolve_hardware

    path = tmp_path / "cpu-local.yaml"
    over = [f"sim.calibrate_output={path}", "sim.calibrate_gemm_size=128",
            "sim.calibrate_buffer_mib=8"]
    assert cli.main(["sim", "calibrate", *over]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    text = path.read_text()
    assert "measured by `llmkit sim calibrate`" in text and "calibrated_at:" in text
    hw = resolve_hardware(compose_tool_config(SimToolConfig, ["hardware=cpu-local", *over]))
    assert hw.source_path == str(path) and hw.calibrated_at is not None
    assert hw.peak_flops["float32"] > 0 and hw.memory_bandwidth > 0  # a shared CPU: any rate
    assert hw.compute_efficiency == 1.0 and hw.memory_efficiency == 1.0
    # without a calibrated file: the shipped placeholder
    missing = compose_tool_config(SimToolConfig, [
        "hardware=cpu-local", f"sim.calibrate_output={tmp_path / 'none.yaml'}"])
    assert resolve_hardware(missing).source_path is None
    # the calibrated profile drives a simulation
    out_dir = tmp_path / "out"
    assert cli.main(["sim", "llama-2-7b", "hardware=cpu-local", *over, "bench.num_requests=2",
                     "bench.input_len=8", "bench.output_len=2",
                     f"bench.output_dir={out_dir}", "bench.result_name=c"]) == 0
    result = json.loads((out_dir / "c.json").read_text())
    assert result["sim"]["hardware_file"] == str(path)
    assert result["sim"]["cost_model"]["dtype"] == "float16"


def test_profile_yaml_names_the_source_of_every_value():
    m = {"device": "cpu", "device_name": "x86_64", "threads": 2, "gemm_size": 64,
         "buffer_mib": 8, "flops": {"float32": 1e11, "bfloat16": 2e10},
         "bandwidth": {"read": 1e10, "copy": 2e10}, "op_overhead_s": 5e-6,
         "step_overhead_s": 2e-4, "memory_bytes": 8e9, "default_dtype": "float32"}
    text = profile_yaml(m, when="2026-01-01T00:00:00")
    for line in text.splitlines():
        if ":" in line and not line.lstrip().startswith("#") and not line.endswith(":") \
                and not line.startswith(("name:", "description:", "default_dtype:",
                                         "calibrated_at:")):
            assert "#" in line, line
    assert "memory_bandwidth_gbs: 20 " in text and "float32: 0.1 " in text
    assert "layer_overhead_us: 75 " in text and "step_overhead_ms: 0.2 " in text


# --------------------------------------------------------------------------- engine calibration

def _groups(cm):
    """The shapes `calibrate engine` times, priced by ``cm``."""
    from llmkit.tools.sim.engine_fit import StepGroup

    groups = [StepGroup(f"prefill {n}", [(n, n, True)], 0.0, 2) for n in (64, 256, 1024)]
    for ctx in (128, 512):
        groups += [StepGroup(f"decode b={b} ctx={ctx}", [(1, ctx + 3, True)] * b, 0.0, 5)
                   for b in (1, 4, 16, 32)]
    groups.append(StepGroup("mixed", [(1, 133, True)] * 8 + [(128, 128, True)], 0.0, 2))
    groups.append(StepGroup("mixed", [(1, 140, True)] * 9 + [(256, 256, True)], 0.0, 2))
    for g in groups:
        g.seconds = cm.step(g.work).total_s
    return groups


def _cpu(**kw):
    from llmkit.cost_model.hardware import HardwareProfile

    base = dict(name="cpu-local", peak_flops={"float32": 150e9}, memory_bytes=16e9,
                memory_bandwidth=25.6e9, compute_efficiency=1.0, memory_efficiency=1.0)
    return HardwareProfile(**{**base, **kw})


def test_frontend_cost_from_a_served_runs_step_trace(tmp_path):
    """A served run whose steps took 1 / (1 - c·R) of what the engine-alone profile prices
    them at, R the tokens/s streamed lately, gives back c."""
    from llmkit.cost_model.hardware import HardwareProfile
    from llmkit.cost_model.step_cost import CostModel, SeqWork
    from llmkit.tools.sim.frontend_cost import frontend_cost_from_trace, step_work

    c = 1.5e-3
    shape, hw = smol_shape(), _cpu(seq_overhead_s=1e-3, token_overhead_s=1e-3)
    served = CostModel(shape, HardwareProfile(**{**hw.as_dict(), "frontend_token_s": c}),
                       "float32")
    shapes = [(0, 0, 0, 8, 8, 8 * 200), (1, 128, 128, 3, 3, 3 * 150), (0, 0, 0, 1, 1, 131),
              (2, 64, 600, 0, 0, 0), (0, 0, 0, 24, 24, 24 * 170)] * 6
    trace = write_served_trace(tmp_path / "served.json", served, shapes)
    fit = frontend_cost_from_trace(trace.path, shape, hw, "float32")
    assert fit.num_steps == len(shapes) and fit.mean_rate > 10
    assert fit.token_s == pytest.approx(c, rel=1e-6) and fit.excess > 0.05
    # a decode step's work is exact: each request its share of the context
    assert step_work(trace.steps[0].to_dict()) == [SeqWork(1, 200, True)] * 8
    # steps no slower than the engine alone: no front-end cost
    for rec in trace.steps:
        rec.execute_ms = 1e3 * CostModel(shape, hw, "float32").step(
            step_work(rec.to_dict())).total_s
    trace.write()
    assert frontend_cost_from_trace(trace.path, shape, hw, "float32").token_s == 0


def test_frontend_cost_refuses_a_file_without_steps(tmp_path):
    from llmkit.tools.sim.frontend_cost import trace_steps

    bad = tmp_path / "x.json"
    bad.write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="sim.calibrate_trace: .*no engine steps"):
        trace_steps(bad)
    with pytest.raises(ValueError, match="sim.calibrate_trace: .*cannot read"):
        trace_steps(tmp_path / "missing.json")


def test_engine_fit_recovers_the_terms_of_a_known_profile():
    from llmkit.cost_model.step_cost import CostModel
    from llmkit.tools.sim.engine_fit import fit_engine

    shape = smol_shape()
    truth = _cpu(compute_efficiency=0.4, memory_efficiency=0.6, step_overhead_s=2e-3,
                 layer_overhead_s=1e-3, seq_overhead_s=1.5e-3, token_overhead_s=2e-4,
                 context_overhead_s=5e-8)
    groups = _groups(CostModel(shape, truth, "float32"))
    fit = fit_engine(shape, "float32", _cpu(), groups, control_plane_s=1e-4)
    assert fit.rms_rel_error < 0.01 and fit.max_rel_error < 0.02, fit.table()
    assert fit.compute_efficiency == pytest.approx(0.4, rel=0.1)
    assert fit.memory_efficiency == pytest.approx(0.6, rel=0.1)
    assert fit.seq_s == pytest.approx(1.5e-3, rel=0.1)
    # the per-step constant: 0.1 ms (the control plane) per step, the rest per layer
    assert fit.step_overhead_s == pytest.approx(1e-4)
    assert fit.step_overhead_s + 30 * fit.layer_overhead_s == pytest.approx(32e-3, rel=0.1)
    # what the fit reports is what the simulator computes with the fitted profile
    again = CostModel(shape, fit.profile, "float32")
    assert [again.step(g.work).total_s for g in groups] == pytest.approx(fit.predicted_s)


def test_engine_fit_raises_a_peak_the_engine_beats_and_leaves_out_an_outlier():
    from llmkit.cost_model.step_cost import CostModel
    from llmkit.tools.sim.engine_fit import fit_engine

    shape = smol_shape()
    # the engine reaches 300 GFLOP/s, a busy microbenchmark measured 150: the peak is raised
    truth = _cpu(peak_flops={"float32": 300e9}, seq_overhead_s=1e-3, step_overhead_s=5e-3)
    groups = _groups(CostModel(shape, truth, "float32"))
    groups[5].seconds *= 8  # a neighbour's burst of CPU use during one shape
    fit = fit_engine(shape, "float32", _cpu(), groups)
    assert fit.fitted.count(False) == 1 and not fit.fitted[5]
    assert fit.max_rel_error < 0.03, fit.table()
    assert fit.profile.peak("float32") == pytest.approx(300e9, rel=0.1)
    assert fit.profile.compute_efficiency == 1.0 and fit.measured_peak_flops == 150e9
    assert "outlier, not fitted" in fit.table()[5]


def test_calibrated_terms_are_validated_beside_the_schema(tmp_path):
    from llmkit.config.errors import ConfigError
    from llmkit.cost_model.hardware import load_profile, load_profile_yaml

    text = (REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml").read_text()
    good = tmp_path / "good.yaml"
    good.write_text(text + "seq_overhead_us: 120\ntoken_overhead_us: 9.5\n"
                           "context_overhead_ns: 40\n")
    hw = load_profile(good)
    assert (hw.seq_overhead_s, hw.token_overhead_s, hw.context_overhead_s) == \
        pytest.approx((120e-6, 9.5e-6, 40e-9))
    assert load_profile(REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml").seq_overhead_s == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "token_overhead_us: -1\n")
    with pytest.raises(ConfigError, match="hardware.token_overhead_us"):
        load_profile(bad)
    assert "seq_overhead_us" in load_profile_yaml(good)


def test_calibrate_engine_and_calibrate_model_pick_the_engine_model(monkeypatch, tmp_path,
                                                                   capsys):
    import llmkit.tools.sim.calibrate as calibrate

    seen = []

    def fake(cfg, log=None):
        seen.append(cfg.engine.model)
        raise SystemExit(0)

    monkeypatch.setattr(calibrate, "run_engine_calibrate", fake)
    with pytest.raises(SystemExit):
        cli.main(["sim", "calibrate", "engine", "model.dtype=float32"])
    assert seen[-1].name == "smollm2-135m-instruct" and seen[-1].dtype == "float32"
    (tmp_path / "m.gguf").write_bytes(b"")  # composing checks that the file exists
    with pytest.raises(SystemExit):
        cli.main(["sim", "calibrate", str(tmp_path / "m.gguf")])
    assert seen[-1].path == str(tmp_path / "m.gguf")


def test_engine_calibration_of_a_tiny_model_predicts_its_own_steps(tiny_model_dir, tmp_path):
    """The real engine on a tiny random model: calibrated, written, read back by
    hardware=cpu-local, and the simulator's step times for the measured shapes agree with the
    measurements (a shared CPU is noisy: the median error is what is held, and one torch
    thread keeps a busy neighbour from stalling OpenMP barriers)."""
    import torch

    threads = torch.get_num_threads()
    try:
        _calibrate_tiny(tiny_model_dir, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _calibrate_tiny(tiny_model_dir, tmp_path):
    from llmkit.cost_model.step_cost import CostModel
    from llmkit.tools.compose import build_tool_config
    from llmkit.tools.sim.calibrate import run_engine_calibrate
    from llmkit.tools.sim.hardware import resolve_hardware
    from llmkit.tools.sim.replay import run_sim

    model = tiny_model_dir("llama", max_position_embeddings=1024)
    path = tmp_path / "cpu-local.yaml"
    over = [f"sim.calibrate_output={path}", "sim.calibrate_gemm_size=128",
            "sim.calibrate_buffer_mib=8", "hardware=cpu-local", "platform.num_threads=1"]
    cfg = build_tool_config(SimToolConfig, str(model), overrides=over)
    lines = []
    written, profile, fit, meas = run_engine_calibrate(
        cfg, log=lines.append, decode_batches=(1, 4, 16), decode_contexts=(64, 256),
        prefill_lens=(32, 128, 512), decode_steps=5)
    assert written == path and lines and not meas.skipped
    text = path.read_text()
    assert "measured by `llmkit sim calibrate engine`" in text
    assert f"real engine running {meas.model_name}" in text and "calibrated_at:" in text
    hw = resolve_hardware(cfg)
    assert hw.source_path == str(path)
    assert 0 < hw.compute_efficiency <= 1 and 0 < hw.memory_efficiency <= 1
    assert min(hw.seq_overhead_s, hw.token_overhead_s, hw.context_overhead_s) >= 0
    labels = {g.label for g in fit.groups}
    assert {"prefill 32", "prefill 512", "decode b=16 ctx=256"} <= labels
    assert any(g.label.startswith("mixed") and g.num_tokens > g.num_seqs for g in fit.groups)
    # the profile as the simulator reads it reproduces the fit ...
    cm = CostModel(meas.shape, hw, meas.dtype)
    predicted = [cm.step(g.work).total_s for g in fit.groups]
    assert predicted == pytest.approx(fit.predicted_s, rel=1e-3)
    # ... and the measurements
    errors = sorted(abs(p / g.seconds - 1) for p, g in zip(predicted, fit.groups))
    assert errors[len(errors) // 2] < 0.3, "\n".join(fit.table())
    # and drives a simulation of the same model
    sim_cfg = build_tool_config(SimToolConfig, str(model), overrides=over + [
        f"sim.dtype={meas.dtype}", "bench.num_requests=4", "bench.input_len=16",
        "bench.output_len=4", f"bench.output_dir={tmp_path}"])
    result = run_sim(sim_cfg)
    assert result["summary"]["completed"] == 4
    assert result["sim"]["hardware_file"] == str(path)
    assert result["sim"]["cost_model"]["seq_overhead_s"] == pytest.approx(hw.seq_overhead_s)
