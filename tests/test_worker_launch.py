"""Several workers from any program (issue 31.14): a script without an ``if __name__ ==
"__main__":`` guard and code fed on standard input run ``LLM(..., tensor_parallel_size=2,
executor="multiproc")`` and get the single-process engine's greedy tokens (before, every worker
re-ran the script or looked for a file ``<stdin>``, and died with exit code 1); and a worker that
dies says why: the last lines of its stderr end the ``WorkerDiedError``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmkit.executor.worker_launch import _has_main_guard

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Once upon a time"]
MAX_TOKENS = 6


def user_code(model_dir: Path) -> str:
    """What a user writes: no guard, the engine built at module level."""
    return textwrap.dedent(f"""\
        import json
        from llmkit import LLM, SamplingParams

        llm = LLM({str(model_dir)!r}, dtype="float32", kv_cache={{"num_blocks": 32}},
                  parallel={{"tensor_parallel_size": 2}}, executor="multiproc")
        params = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True)
        outs = llm.generate({PROMPTS!r}, params, use_tqdm=False)
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        """)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    from llmkit import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache={"num_blocks": 32})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def run_user_code(args: list[str], stdin: str | None, cwd: Path) -> list[list[int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLMKIT_COMPILATION_MODE": "eager"}
    proc = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    return json.loads(line[len("TOKENS "):])


def test_a_script_without_a_main_guard_runs_tensor_parallel(tiny_model_dir, expected, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(user_code(tiny_model_dir("llama")))
    assert not _has_main_guard(script.read_text())
    assert run_user_code([str(script)], None, tmp_path) == expected


def test_code_on_stdin_runs_tensor_parallel(tiny_model_dir, expected, tmp_path):
    assert run_user_code([], user_code(tiny_model_dir("llama")), tmp_path) == expected


def test_main_guard_detection():
    assert _has_main_guard('import x\nif __name__ == "__main__":\n    x.run()\n')
    assert _has_main_guard("if '__main__' == __name__:\n    pass\n")
    assert not _has_main_guard("x = 1\ndef f():\n    if __name__ == '__main__':\n        pass\n")
    assert not _has_main_guard("if __name__ != '__main__':\n    pass\n")


def test_a_dead_worker_says_why(tiny_model_dir, tmp_path, monkeypatch):
    """Workers that die while starting (here a sitecustomize that prints and exits, before the
    worker's own code runs: no report on the pipe) end the error with their stderr."""
    from llmkit import LLM
    from llmkit.executor.multiproc import WorkerDiedError

    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--multiprocessing-fork' in sys.orig_argv:  # a spawned child, nothing else\n"
        "    sys.stderr.write('worker-setup: cannot open /nonexistent/device (marker 5417)\\n')\n"
        "    sys.stderr.flush()\n"
        "    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    with pytest.raises(WorkerDiedError) as info:
        LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache={"num_blocks": 32},
            parallel={"tensor_parallel_size": 2}, executor="multiproc")
    message = str(info.value)
    assert "exit code 3" in message
    assert "stderr ---" in message and "marker 5417" in message
