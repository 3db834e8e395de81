"""``llmkit sim calibrate``: this machine's figures as the ``cpu-local`` profile."""
from __future__ import annotations

import json

from llmkit.config.compose import compose_config
from llmkit.entrypoints import cli
from llmkit.sim.calibrate import profile_yaml


def test_calibrate_writes_cpu_local_and_hardware_cpu_local_reads_it(tmp_path, capsys):
    from llmkit.sim.hardware import resolve_hardware

    path = tmp_path / "cpu-local.yaml"
    over = [f"sim.calibrate_output={path}", "sim.calibrate_gemm_size=128",
            "sim.calibrate_buffer_mib=8"]
    assert cli.main(["sim", "calibrate", *over]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    text = path.read_text()
    assert "measured by `llmkit sim calibrate`" in text and "calibrated_at:" in text
    hw = resolve_hardware(compose_config(["hardware=cpu-local", *over]))
    assert hw.source_path == str(path) and hw.calibrated_at is not None
    assert hw.peak_flops["float32"] > 0 and hw.memory_bandwidth > 0  # a shared CPU: any rate
    assert hw.compute_efficiency == 1.0 and hw.memory_efficiency == 1.0
    # without a calibrated file: the shipped placeholder
    missing = compose_config(["hardware=cpu-local",
                              f"sim.calibrate_output={tmp_path / 'none.yaml'}"])
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
