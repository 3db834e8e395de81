"""bench.baseline=llamacpp: the commands llmkit runs and how it reads their JSON lines (fake
binaries that record their arguments and print what llama.cpp prints), and the start-up
errors. The real binaries run in benchmarks (README: "Quantized weights")."""
from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmkit.config.errors import ConfigError
from llmkit.tools.bench.llamacpp_baseline import check_llamacpp, run_llamacpp

BENCH = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.txt"
case "$*" in
  *"-n 0"*) echo '{"n_prompt": 128, "n_gen": 0, "avg_ts": 400.0}' ;;
  *) echo '{"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0}' ;;
esac
"""
BATCHED = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.txt"
echo 'main: some log line' >&2
echo '{"n_kv_max": 16384, "pp": 128, "tg": 128, "pl": 64, "t": 80.0, "speed_pp": 900.0, "speed_tg": 180.0}' >&2
"""


def fake_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("llama-bench", BENCH), ("llama-batched-bench", BATCHED)):
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return folder


def bench_cfg(folder, **kw):
    return SimpleNamespace(**{"llamacpp_bin_dir": str(folder), "dataset": "random",
                              "range_ratio": 0.0, **kw})


def test_one_sequence_runs_llama_bench_at_depth(tmp_path):
    folder = fake_bin(tmp_path)
    r = run_llamacpp(folder, tmp_path / "m.gguf", threads=2, num_seqs=1, input_len=128,
                     output_len=128, reps=2)
    calls = (folder / "calls.txt").read_text().splitlines()
    assert any("-p 128 -n 0" in c for c in calls)
    assert any("-p 0 -n 128 -d 128" in c and "-t 2" in c and "-r 2" in c for c in calls)
    assert r["decode_throughput"] == 100.0 and r["prompt_throughput"] == 400.0
    assert r["output_throughput"] == pytest.approx(128 / (128 / 400 + 128 / 100))


def test_many_sequences_run_batched_bench(tmp_path):
    folder = fake_bin(tmp_path)
    r = run_llamacpp(folder, tmp_path / "m.gguf", threads=2, num_seqs=64, input_len=128,
                     output_len=128)
    [call] = (folder / "calls.txt").read_text().splitlines()
    assert "-npp 128 -ntg 128 -npl 64" in call and f"-c {64 * 256}" in call
    assert r["output_throughput"] == pytest.approx(64 * 128 / 80.0)
    assert r["decode_throughput"] == 180.0
    json.dumps(r)


def test_start_up_errors_name_the_key(tmp_path):
    folder = fake_bin(tmp_path)
    gguf = tmp_path / "m.gguf"
    assert check_llamacpp(bench_cfg(folder), gguf) == folder
    with pytest.raises(ConfigError, match="bench.llamacpp_bin_dir"):
        check_llamacpp(bench_cfg(None), gguf)
    with pytest.raises(ConfigError, match="bench.llamacpp_bin_dir.*missing"):
        check_llamacpp(bench_cfg(tmp_path), gguf)
    with pytest.raises(ConfigError, match="bench.baseline"):
        check_llamacpp(bench_cfg(folder), tmp_path / "hf-folder")
    with pytest.raises(ConfigError, match="bench.dataset"):
        check_llamacpp(bench_cfg(folder, range_ratio=0.5), gguf)
