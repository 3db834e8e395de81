"""The OpenMP environment of llmkit's own processes, set before torch loads.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp), which reads its wait
policy once, when it loads (with torch): threads that finish a region spin for
``GOMP_SPINCOUNT`` iterations (300,000 by default) before they sleep. A small model's decode
step is ~300 short regions; when another process takes one of the cores, spinning threads hold
theirs while the thread they wait for is descheduled, and a step takes 10-25x as long
(``benchmarks/cpu_contention_bench.py`` measures it). So the processes that compute make
their threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``), set before torch is imported:

- ``engine`` (the engine-core process of ``llmkit serve``; ``llmkit generate`` / ``chat``,
  which run the engine in their own process): ``ENGINE_CPU_ENV``. Thread count and binding stay
  as they are: all the cores the process may use (``platform.num_threads``), unbound, so that
  the OS can move a thread off a core another process took.
- the API server's process computes nothing in parallel: it runs torch with one thread
  (``torch.set_num_threads(1)`` in ``llmkit serve``), so it has no OpenMP workers to spin.

Variables the user has set are kept. On CUDA the engine's CPU threads barely compute and
nothing is set. ``LLM`` inside a user's own process cannot be helped this way (torch is loaded
by then): set ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` before starting Python (the README says
what to set).
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

__all__ = ["ENGINE_CPU_ENV", "apply_engine_openmp_env", "likely_cuda"]

logger = logging.getLogger(__name__)

# Measured with benchmarks/cpu_contention_bench.py (README, "Speed on the CPU"): on a shared
# 2-core machine, one-sequence decode ran ~7x faster passive than with libgomp's default spin,
# and lost 14% (not 66%) beside a busy-loop process; a short spin (GOMP_SPINCOUNT=10000) was
# in between.
ENGINE_CPU_ENV: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


def likely_cuda(platform_name: str) -> bool:
    """Whether the engine will run on CUDA, known before torch is imported: ``platform=cuda``,
    or ``auto`` on a machine with an NVIDIA driver."""
    if platform_name == "cuda":
        return True
    return platform_name == "auto" and os.path.exists("/dev/nvidiactl")


def apply_engine_openmp_env(platform_name: str = "auto",
                            environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``ENGINE_CPU_ENV`` in ``environ`` (default ``os.environ``) where the user has set
    neither variable of the wait policy; returns what was set. Must run before torch is
    imported (else it only logs that it is too late)."""
    env = os.environ if environ is None else environ
    if likely_cuda(platform_name):
        return {}
    if any(k in env for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        return {}  # the user's choice
    if environ is None and "torch" in sys.modules:
        logger.debug("torch is already loaded: its OpenMP wait policy can no longer change")
        return {}
    env.update(ENGINE_CPU_ENV)
    return dict(ENGINE_CPU_ENV)
