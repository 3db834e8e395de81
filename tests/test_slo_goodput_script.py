"""``benchmarks/slo_goodput.py``'s pieces that need no server: the markdown table of a rate
sweep (goodput by rate and config, then each run), the llama-server command line, and its
refusal to run llama-server without a binary. (The sweep itself serves real models: the lead
runs it alone, docs/slo.md.)"""
from __future__ import annotations

import pytest

import slo_goodput


def _summary(goodput: float, done: int = 48) -> dict:
    return {"goodput": goodput, "completed": done, "num_requests": 48,
            "slo_attainment_by_metric": {"ttft": 1.0, "tpot": goodput, "all": goodput / 2},
            "ttft_ms": {"p99": 1234.4}, "tpot_ms": {"mean": 56.6}}


def test_the_markdown_table_has_goodput_by_rate_and_config_then_each_run():
    results = [("default", 0.5, _summary(0.4)), ("default", 1.0, _summary(0.8)),
               ("llama-server", 0.5, _summary(0.25, 47))]
    text = slo_goodput.markdown(results, "SLO: TTFT <= 1500 ms")
    lines = text.splitlines()
    assert lines[0] == "SLO: TTFT <= 1500 ms"
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| rate req/s |"))
    assert lines[head] == ("| rate req/s | llmkit default (token budget) | "
                           "llama-server (llama.cpp) |")
    assert lines[head + 2] == "| 0.5 | 0.400 | 0.250 |"
    assert lines[head + 3] == "| 1 | 0.800 |  |"  # llama-server not run at 1 req/s
    assert ("| llama-server (llama.cpp) | 0.5 | 0.250 | 100% | 25% | 12% | 1,234 | 57 "
            "| 47/48 |") in lines


def test_llama_server_command():
    cmd = slo_goodput.llama_server_cmd("/bin/llama-server", "/m.gguf", 8123, threads=2,
                                       parallel=16, ctx_per_slot=448)
    assert cmd[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--port"] == "8123" and flags["-t"] == "2" and flags["-tb"] == "2"
    assert flags["-np"] == "16" and flags["-c"] == str(16 * 448)


def test_llama_server_without_a_binary_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        slo_goodput.main(["--configs", "llama-server", "--llama-server",
                          str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "llamacpp_setup.sh" in capsys.readouterr().err


def test_vllm_command_and_environment():
    cmd = slo_goodput.vllm_cmd("/venv/bin/vllm", "/m-hf", 8124, dtype="bfloat16")
    assert cmd[:3] == ["/venv/bin/vllm", "serve", "/m-hf"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--port"] == "8124" and flags["--dtype"] == "bfloat16"
    assert slo_goodput.vllm_env(4) == {"VLLM_TARGET_DEVICE": "cpu",
                                       "VLLM_CPU_KVCACHE_SPACE": "4"}


def test_vllm_column_is_skipped_without_vllm(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert slo_goodput.vllm_missing(str(tmp_path / "bin" / "vllm"), str(folder))
    assert slo_goodput.vllm_missing(None, str(folder))
    binary = tmp_path / "vllm"
    binary.write_text("")
    assert slo_goodput.vllm_missing(str(binary), str(folder)) is None
    assert "--vllm-model" in slo_goodput.vllm_missing(str(binary), str(tmp_path / "none"))
    with pytest.raises(SystemExit) as e:  # the only config, skipped: nothing left to run
        slo_goodput.main(["--configs", "vllm", "--vllm", str(tmp_path / "bin" / "vllm"),
                          "--vllm-model", str(folder), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "skipping config vllm: no vLLM binary" in err


def test_llmkit_servers_wait_for_their_step_graphs():
    assert slo_goodput.graphs_before_timing(["recipe=r.yaml"]) == [
        "compilation.background=false", "recipe=r.yaml"]
    assert slo_goodput.graphs_before_timing(["compilation.background=true"]) == [
        "compilation.background=true"]
