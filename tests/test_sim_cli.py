"""``llmkit sim`` and ``llmkit sim calibrate`` from the command line, and the config they use."""
from __future__ import annotations

import json

import pytest

from llmkit.entrypoints import cli
from llmkit.tools.compose import compose_tool_config
from llmkit.tools.schema import SimToolConfig


def test_hardware_group_and_sim_executor_compose():
    cfg = compose_tool_config(SimToolConfig)
    assert cfg.hardware.name == "a100-80gb" and cfg.sim.model is None
    cfg = compose_tool_config(SimToolConfig, ["hardware=l4", "executor=sim"])
    assert (cfg.hardware.name, cfg.engine.executor.name) == ("l4", "sim")
    assert cfg.hardware.efficiency.memory == 0.8  # the profile's own, as shipped


def test_llmkit_config_prints_the_engine_and_only_the_tool_sections_named(capsys):
    """The engine's config holds no tool's section: a plain ``llmkit config`` shows no
    hardware profile (no a100-80gb block on a CPU); naming one shows it. (``slo`` is the
    engine's: scheduler=slo serves to it.)"""
    import yaml

    assert cli.main(["config"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert "scheduler" in doc and not {"bench", "hardware", "sim"} & set(doc)
    assert doc["slo"] == {"ttft_ms": None, "tpot_ms": None, "e2el_ms": None}
    assert cli.main(["config", "hardware=h100-sxm", "sim.tensor_parallel_size=2"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["hardware"]["name"] == "h100-sxm" and doc["sim"]["tensor_parallel_size"] == 2
    assert "scheduler" in doc and "bench" not in doc
    # a tool's key is validated whichever command runs
    assert cli.main(["config", "bench.rate=abc"]) == 2
    assert capsys.readouterr().err.startswith("llmkit: error: bench.rate: got 'abc'")


def test_bad_hardware_is_one_line_with_the_options(capsys):
    assert cli.main(["config", "hardware=tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: hardware: got 'tpu'; allowed: a100-80gb")
    assert "h200" in err and "cpu-local" in err and err.count("\n") == 1


def test_sim_writes_the_bench_serve_result_and_figure(tmp_path, capsys):
    argv = ["sim", "llama-2-7b", "hardware=h100-sxm", "bench.num_requests=20", "bench.rate=5",
            "bench.output_len=16", "slo.ttft_ms=100", f"bench.output_dir={tmp_path}",
            "bench.result_name=run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Simulated Serving Result" in out and "on h100-sxm x1" in out
    result = json.loads((tmp_path / "run.json").read_text())
    assert (tmp_path / "run.png").stat().st_size > 10_000
    assert result["simulated"] is True and result["summary"]["completed"] == 20
    assert result["config"]["bench"]["num_requests"] == 20
    assert result["config"]["slo"]["ttft_ms"] == 100


def test_sim_sweep_names_each_point(tmp_path, capsys):
    argv = ["sim", "-m", "sim.model=llama-2-7b", "bench.rate=2,8", "bench.num_requests=10",
            "bench.output_len=8", f"bench.output_dir={tmp_path}"]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["sim-bench.rate=2.json",
                                                              "sim-bench.rate=8.json"]
    assert "plot the sweep" in capsys.readouterr().out


def test_sim_errors_are_one_line(capsys, tmp_path):
    assert cli.main(["sim", "sim.model=no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: no model shape 'no-such-model'")
    assert "llama-2-7b" in err and err.count("\n") == 1
    assert cli.main(["sim", "sim.model=llama-2-70b", f"bench.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: sim.tensor_parallel_size:") and err.count("\n") == 1
    assert cli.main(["sim", "calibrate", "-m"]) == 2
    capsys.readouterr()
    # a bad step trace is refused before the engine is built and timed
    missing = tmp_path / "no-trace.json"
    assert cli.main(["sim", "calibrate", "engine", f"sim.calibrate_trace={missing}",
                     f"sim.calibrate_output={tmp_path / 'p.yaml'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sim.calibrate_trace" in err and "cannot read" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.yaml").exists()


def test_sim_takes_a_config_json_as_model(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 512, "eos_token_id": 2}))
    out_dir = tmp_path / "out"
    assert cli.main(["sim", str(model / "config.json"), "bench.num_requests=5",
                     "bench.output_len=4", f"bench.output_dir={out_dir}",
                     "bench.result_name=r"]) == 0
    result = json.loads((out_dir / "r.json").read_text())
    assert result["sim"]["model"]["hidden_size"] == 256
    assert result["sim"]["max_model_len"] == 512
    # a tiny model on an 80 GB device: the pool is capped at max_num_seqs full sequences
    assert result["sim"]["num_kv_blocks"] == 512 // 16 * 256


@pytest.mark.parametrize("argv,sub", [(["sim", "calibrate"], "calibrate"), (["sim"], None),
                                      (["sim", "llama-2-7b"], None)])
def test_parse_sim_subcommand(argv, sub):
    args = cli.parse_args(argv)
    assert args.command == "sim" and args.subcommand == sub
