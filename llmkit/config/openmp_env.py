"""The OpenMP wait policy of every process of llmkit that computes, set before torch loads.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp), which reads its wait
policy once, when it loads (with torch): threads that finish a region spin for
``GOMP_SPINCOUNT`` iterations (300,000 by default) before they sleep. A small model's decode
step is ~300 short regions; when another process takes one of the cores, spinning threads hold
theirs while the thread they wait for is descheduled, and a step takes 10-25x as long
(``benchmarks/cpu_contention_bench.py`` measures it). Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) costs a wake-up per region instead, which on an idle machine halves
one-sequence decode. So the processes that compute spin briefly and then sleep
(``ENGINE_CPU_ENV``: ``GOMP_SPINCOUNT=1000``, about a microsecond): a thread that is still
running finds the next region without a wake-up, one that was descheduled costs its waiters
little; the measured trade-off is in ``docs/cpu-speed.md``. This module is the one place that
decides it. Who applies it, always before torch is imported there:

- the ``llmkit`` CLI, at the top of command dispatch (``apply_engine_openmp_env``), for every
  command that computes: ``generate``, ``chat``, ``bench``, ``eval``, ``sim`` (they run an
  engine, a baseline or a calibration in their own process) and ``serve`` (its API process
  computes with one thread; the engine-core process it spawns inherits the environment).
- processes llmkit spawns inherit ``os.environ`` as it is when they start; where the parent may
  lack the policy (an ``LLM`` or ``AsyncLLM`` in a user's own process), the spawner sets it for
  the child (``openmp_env_for_children``): the engine core (``engine/process/client.py``) and
  ``executor=multiproc``'s workers (``executor/multiproc.py``; a spawned child may load torch
  before its target runs, when it re-imports the parent's ``__main__``, so the child itself
  would be too late). Ray's actors get it in their ``runtime_env`` (``wait_policy_env``),
  local cluster or not.

Thread counts are not set here: an engine uses all the cores the process may use
(``platform.num_threads``; unbound, so that the OS can move a thread off a core another process
took), a multiproc or Ray rank its share (``threads_per_rank``), the API server one thread.

Variables the user has set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) are kept, and passed on
to the children. On CUDA the engine's CPU threads barely compute and nothing is set.

``LLM`` inside a user's own process cannot be helped: torch is loaded with llmkit, before it
could set anything. Export ``GOMP_SPINCOUNT=1000`` before starting Python
(``GOMP_SPINCOUNT=1000 python app.py``); ``LLM`` on the CPU logs one warning
(``warn_if_threads_spin``) when it finds torch loaded without a wait policy in the environment.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

__all__ = ["ENGINE_CPU_ENV", "WAIT_POLICY_VARS", "apply_engine_openmp_env", "likely_cuda",
           "openmp_env_for_children", "wait_policy_env", "warn_if_threads_spin"]

logger = logging.getLogger(__name__)

# A short spin, then sleep: benchmarks/cpu_contention_bench.py compares it with sleeping at once
# (PASSIVE), libgomp's default spin and longer ones, alone and beside a busy process.
ENGINE_CPU_ENV: Mapping[str, str] = {"GOMP_SPINCOUNT": "1000"}
# Either one set by the user is their choice of wait policy.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_warned = False  # warn_if_threads_spin: once per process


def likely_cuda(platform_name: str) -> bool:
    """Whether the engine will run on CUDA, known before torch is imported: ``platform=cuda``,
    or ``auto`` on a machine with an NVIDIA driver."""
    if platform_name == "cuda":
        return True
    return platform_name == "auto" and os.path.exists("/dev/nvidiactl")


def _user_choice(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in WAIT_POLICY_VARS if k in env}


def wait_policy_env(on_cpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The wait-policy variables a computing process started from here should have: the
    user's own where set in ``environ`` (default ``os.environ``), else ``ENGINE_CPU_ENV`` on
    the CPU, else none."""
    mine = _user_choice(os.environ if environ is None else environ)
    if mine or not on_cpu:
        return mine
    return dict(ENGINE_CPU_ENV)


def apply_engine_openmp_env(platform_name: str = "auto",
                            environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``ENGINE_CPU_ENV`` in ``environ`` (default ``os.environ``) where the user has set
    neither variable of the wait policy; returns what was set. Must run before torch is
    imported (else it only logs that it is too late)."""
    env = os.environ if environ is None else environ
    if likely_cuda(platform_name) or _user_choice(env):
        return {}
    if environ is None and "torch" in sys.modules:
        logger.debug("torch is already loaded: its OpenMP wait policy can no longer change")
        return {}
    env.update(ENGINE_CPU_ENV)
    return dict(ENGINE_CPU_ENV)


@contextmanager
def openmp_env_for_children(on_cpu: bool) -> Iterator[dict[str, str]]:
    """Around starting processes (``multiprocessing`` spawn copies ``os.environ`` at
    ``start()``): ``os.environ`` has the wait policy while they start, then is as it was.
    Yields what was added (nothing where this process already has a policy)."""
    added = {k: v for k, v in wait_policy_env(on_cpu).items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield added
    finally:
        for k in added:
            os.environ.pop(k, None)


def warn_if_threads_spin(on_cpu: bool) -> bool:
    """One warning per process (``LLM`` on the CPU): torch was loaded with no wait policy in
    the environment, so its threads spin. Returns whether it warned now."""
    global _warned
    if _warned or not on_cpu or "torch" not in sys.modules or _user_choice(os.environ):
        return False
    _warned = True
    logger.warning("torch's OpenMP threads spin after each parallel region (it was loaded "
                   "without a wait policy), so decode slows down many times over when another "
                   "process shares the cores: export GOMP_SPINCOUNT=1000 (a short spin, then "
                   "sleep) before starting Python")
    return True
