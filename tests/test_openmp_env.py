"""The OpenMP wait policy of llmkit's computing processes (llmkit.config.openmp_env): set
before torch loads, never over the user's own choice, not for CUDA engines."""
from __future__ import annotations

import os
import subprocess
import sys

from llmkit.config.openmp_env import ENGINE_CPU_ENV, apply_engine_openmp_env


def test_engine_env_is_set_unless_the_user_chose():
    env: dict[str, str] = {}
    assert apply_engine_openmp_env("cpu", env) == dict(ENGINE_CPU_ENV)
    assert env == dict(ENGINE_CPU_ENV) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000000"}):
        env = dict(mine)
        assert apply_engine_openmp_env("cpu", env) == {} and env == mine
    assert apply_engine_openmp_env("cuda", env := {}) == {} and env == {}


def test_cli_sets_it_before_torch_loads():
    """generate/chat run the engine in the CLI's process: the variable is in its environment
    before anything imports torch (libgomp reads it once, when torch loads)."""
    code = ("import sys; from llmkit.entrypoints import cli; "
            "cli._set_engine_openmp_env(cli.parse_args(['chat'])); import os; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stdout.split() == ["False", "PASSIVE"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, timeout=120)
    assert out.stdout.split() == ["False", "ACTIVE"], out.stderr
