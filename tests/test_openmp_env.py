"""The OpenMP wait policy of llmkit's computing processes (llmkit.config.openmp_env): set
before torch loads by every command that computes, passed to the processes llmkit spawns,
never over the user's own choice, not for CUDA engines; ``LLM`` warns once where it is too
late."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from llmkit.config import openmp_env
from llmkit.config.openmp_env import (ENGINE_CPU_ENV, WAIT_POLICY_VARS, apply_engine_openmp_env,
                                      openmp_env_for_children, wait_policy_env,
                                      warn_if_threads_spin)
from llmkit.entrypoints import cli

# argv of each command that computes (the policy is set) and of those that do not.
COMPUTING = {
    "generate": ["generate", "--prompt", "hi"],
    "chat": ["chat"],
    "serve": ["serve"],
    "bench": ["bench", "latency", "bench.batch_size=1", "bench.input_len=128"],
    "eval": ["eval", "ppl", "eval.text_file=x.txt"],
    "sim": ["sim", "hardware=h100-sxm"],
    "plan": ["plan", "plan.verify_top=0"],
}
NOT_COMPUTING = {"config": ["config"], "proxy": ["proxy"]}


@pytest.fixture
def no_user_policy(monkeypatch):
    for k in WAIT_POLICY_VARS:
        monkeypatch.delenv(k, raising=False)


def test_engine_env_is_set_unless_the_user_chose():
    env: dict[str, str] = {}
    assert apply_engine_openmp_env("cpu", env) == dict(ENGINE_CPU_ENV)
    assert env == dict(ENGINE_CPU_ENV) and env["GOMP_SPINCOUNT"] == "1000"
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000000"}):
        env = dict(mine)
        assert apply_engine_openmp_env("cpu", env) == {} and env == mine
    assert apply_engine_openmp_env("cuda", env := {}) == {} and env == {}


def test_children_get_the_user_choice_or_the_short_spin_on_the_cpu():
    assert wait_policy_env(True, {}) == {"GOMP_SPINCOUNT": "1000"}
    assert wait_policy_env(False, {}) == {}
    mine = {"GOMP_SPINCOUNT": "10000", "PATH": "/bin"}
    assert wait_policy_env(True, mine) == wait_policy_env(False, mine) == {
        "GOMP_SPINCOUNT": "10000"}


def test_the_dispatcher_applies_it_first_for_each_command_that_computes(monkeypatch):
    """main() sets the policy before the command's handler runs (the handler is what imports
    torch), for every command that computes, with the platform the command line names."""
    calls: list[tuple] = []
    monkeypatch.setattr(openmp_env, "apply_engine_openmp_env",
                        lambda platform="auto", environ=None: calls.append(("apply", platform)))
    handlers = {name: (lambda args, name=name: calls.append(("run", name)) or 0)
                for name in cli.HANDLERS}
    monkeypatch.setattr(cli, "HANDLERS", handlers)
    assert set(COMPUTING) == set(cli.COMPUTE_COMMANDS)
    for name, argv in COMPUTING.items():
        calls.clear()
        assert cli.main(argv) == 0
        assert calls == [("apply", "auto"), ("run", name)], name
        calls.clear()
        assert cli.main([*argv, "platform=cuda"]) == 0
        assert calls == [("apply", "cuda"), ("run", name)], name
    for name, argv in NOT_COMPUTING.items():
        calls.clear()
        assert cli.main(argv) == 0 and calls == [("run", name)], name


# Each command dispatched in a fresh-enough state: the variable dropped again when llmkit set
# it, the handler a stub that reports what it found (the real ones would import torch).
_PROBE = """
import json, os, sys
from llmkit.entrypoints import cli
seen = {}
def probe(args):
    seen[args.command] = ["torch" in sys.modules,
                          {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                           if k in os.environ}]
    return 0
cli.HANDLERS = {name: probe for name in cli.HANDLERS}
user = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
for argv in json.loads(sys.argv[1]):
    assert cli.main([*argv, "platform=cpu"]) == 0
    if not user:
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.pop("GOMP_SPINCOUNT", None)
print(json.dumps(seen))
"""


@pytest.mark.parametrize("mine", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}])
def test_each_command_has_it_in_its_environment_before_torch_loads(mine):
    """In a real process: when each command's handler starts, torch is not loaded yet and the
    environment holds llmkit's short spin, or the user's own choice untouched."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARS}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(COMPUTING.values()))],
                         capture_output=True, text=True, env={**env, **mine}, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    want = mine or {"GOMP_SPINCOUNT": "1000"}
    assert seen == {name: [False, want] for name in COMPUTING}


def test_spawned_children_start_with_it_and_the_parent_env_is_left_as_it_was(no_user_policy):
    """multiprocessing's spawn copies os.environ at start(): the child's initial environment
    (/proc/PID/environ) has the policy, and the parent's is unchanged afterwards."""
    spawn = multiprocessing.get_context("spawn")

    def child_env(on_cpu: bool) -> dict[str, str]:
        proc = spawn.Process(target=time.sleep, args=(30,), daemon=True)
        with openmp_env_for_children(on_cpu):
            proc.start()
        try:
            # start() returns after the fork; /proc shows the new environment after the exec
            deadline = time.monotonic() + 30
            while b"spawn_main" not in _read(f"/proc/{proc.pid}/cmdline"):
                assert time.monotonic() < deadline, "the child never started"
                time.sleep(0.01)
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                items = [e.decode().partition("=") for e in f.read().split(b"\0") if e]
        finally:
            proc.kill()
            proc.join()
        return {k: v for k, _, v in items if k in WAIT_POLICY_VARS}

    assert child_env(True) == {"GOMP_SPINCOUNT": "1000"}
    assert not set(WAIT_POLICY_VARS) & set(os.environ)
    assert child_env(False) == {}
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the user's: kept, nothing added
    assert child_env(True) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_llm_warns_once_when_torch_spins(no_user_policy, monkeypatch, tiny_model_dir):
    """LLM in a user's process on the CPU, torch loaded with no wait policy: one warning line
    naming the variable, once per process; none where the user chose a policy."""
    import torch  # noqa: F401 - loaded, as in any process that built an LLM

    from llmkit import LLM

    monkeypatch.setattr(openmp_env, "_warned", False)
    records = _Records()
    openmp_env.logger.addHandler(records)
    try:
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", platform="cpu")
        llm.engine.shutdown()
        assert len(records.lines) == 1 and "\n" not in records.lines[0]
        assert "export GOMP_SPINCOUNT=1000" in records.lines[0]
        assert not warn_if_threads_spin(True)  # once per process
        monkeypatch.setattr(openmp_env, "_warned", False)
        assert not warn_if_threads_spin(False)  # CUDA: nothing to say
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert not warn_if_threads_spin(True)  # the user's choice
        assert len(records.lines) == 1
    finally:
        openmp_env.logger.removeHandler(records)
