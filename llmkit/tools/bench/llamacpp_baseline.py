"""The llama.cpp baseline (``bench.baseline=llamacpp``): llama.cpp's own benchmarks on the same
GGUF file, thread count and lengths, run as subprocesses from ``bench.llamacpp_bin_dir``.

- one sequence (``bench throughput`` with ``num_requests=1``, ``bench latency`` with
  ``batch_size=1``): ``llama-bench -p IN -n 0`` (prompt tokens/s) and ``llama-bench -p 0 -n OUT
  -d IN`` (decode tokens/s with the prompt already in the KV cache);
- N sequences: ``llama-batched-bench -npp IN -ntg OUT -npl N`` (prompts not shared): its total
  time T gives the end-to-end output throughput ``N * OUT / T``, its ``S_TG`` the decode one.

Throughputs compare like with like: ``output_throughput`` is generated tokens over the whole
wall time (prefill included), ``decode_throughput`` the decode steps alone.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from llmkit.config.errors import ConfigError

__all__ = ["check_llamacpp", "run_llamacpp"]

BINARIES = ("llama-bench", "llama-batched-bench")


def check_llamacpp(b: Any, model_path: Path) -> Path:
    """The binaries' folder, or a ConfigError naming the key that is wrong."""
    if b.llamacpp_bin_dir is None:
        raise ConfigError("bench.llamacpp_bin_dir", ConfigError.MISSING,
                          "the folder holding llama.cpp's llama-bench and llama-batched-bench "
                          "(bench.baseline=llamacpp)")
    folder = Path(b.llamacpp_bin_dir).expanduser()
    missing = [n for n in BINARIES if not (folder / n).is_file()]
    if missing:
        raise ConfigError("bench.llamacpp_bin_dir", str(folder),
                          f"a folder holding {' and '.join(BINARIES)} (missing: "
                          f"{', '.join(missing)})")
    if Path(model_path).suffix.lower() != ".gguf":
        raise ConfigError("bench.baseline", "llamacpp",
                          f"none, hf (llamacpp runs a .gguf model; {str(model_path)!r} is not)")
    if b.dataset != "random" or b.range_ratio:
        raise ConfigError("bench.dataset", b.dataset, "", message=(
            "bench.baseline=llamacpp needs equal lengths: bench.dataset=random with "
            f"bench.range_ratio=0 (got {b.dataset}, range_ratio={b.range_ratio})"))
    return folder


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}: "
                           f"{proc.stderr.strip().splitlines()[-1:] or ''}")
    return proc.stdout + "\n" + proc.stderr


def _json_lines(text: str, start: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (raw.strip() for raw in text.splitlines())
            if line.startswith(start)]


def run_llamacpp(folder: Path, model_path: Path, *, threads: int, num_seqs: int,
                 input_len: int, output_len: int, reps: int = 3) -> dict[str, Any]:
    """The baseline's figures (tokens/s; seconds) for ``num_seqs`` sequences of
    ``input_len + output_len`` tokens."""
    model = str(model_path)
    if num_seqs == 1:
        bench = str(folder / "llama-bench")
        common = ["-m", model, "-t", str(threads), "-r", str(reps), "-o", "jsonl"]
        pp = _json_lines(_run([bench, *common, "-p", str(input_len), "-n", "0"]), "{")
        tg = _json_lines(_run([bench, *common, "-p", "0", "-n", str(output_len),
                               "-d", str(input_len)]), "{")
        pp_ts = next(r["avg_ts"] for r in pp if r.get("n_prompt") == input_len)
        tg_ts = next(r["avg_ts"] for r in tg if r.get("n_gen") == output_len)
        elapsed = input_len / pp_ts + output_len / tg_ts
        tool = f"llama-bench -p {input_len} -n 0 / -p 0 -n {output_len} -d {input_len}"
        prompt_ts, decode_ts = pp_ts, tg_ts
    else:
        cmd = [str(folder / "llama-batched-bench"), "-m", model, "-t", str(threads),
               "-tb", str(threads), "-c", str(num_seqs * (input_len + output_len)),
               "-b", "2048", "-ub", "512", "-npp", str(input_len), "-ntg", str(output_len),
               "-npl", str(num_seqs), "--output-format", "jsonl"]
        rows = [r for r in _json_lines(_run(cmd), '{"n_kv_max"')
                if (r["pp"], r["tg"], r["pl"]) == (input_len, output_len, num_seqs)]
        if not rows:
            raise RuntimeError("llama-batched-bench printed no result for "
                               f"{num_seqs} x ({input_len} + {output_len})")
        r = rows[0]
        elapsed, prompt_ts, decode_ts = r["t"], r["speed_pp"], r["speed_tg"]
        tool = (f"llama-batched-bench -npp {input_len} -ntg {output_len} -npl {num_seqs}")
    out_tokens = num_seqs * output_len
    return {"name": "llamacpp", "tool": tool, "threads": threads, "elapsed_s": elapsed,
            "output_throughput": out_tokens / elapsed,
            "request_throughput": num_seqs / elapsed,
            "decode_throughput": decode_ts, "prompt_throughput": prompt_ts}
