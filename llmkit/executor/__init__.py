"""Executors, picked by ``executor=NAME`` (``auto``: uniproc for one worker, multiproc for
several)."""
from __future__ import annotations

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.registry import Registry

EXECUTORS: Registry[Executor] = Registry("executor")
EXECUTORS.register_lazy("uniproc", "llmkit.executor.uniproc.UniprocExecutor")
EXECUTORS.register_lazy("multiproc", "llmkit.executor.multiproc.MultiprocExecutor")
EXECUTORS.register_lazy("ray", "llmkit.executor.ray_executor.RayExecutor")
# `sim` (no model: steps priced by a hardware cost model, llmkit/tools/sim/executor.py) registers
# itself through the `llmkit.executor` entry point group (pyproject.toml).


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class ``config`` asks for, ``auto`` resolved by the number of workers."""
    ex = config.executor
    world = config.parallel.world_size
    name = ex.name
    if not ex.target and name == "auto":
        name = "uniproc" if world == 1 else "multiproc"
    if not ex.target and name == "uniproc" and world > 1:
        raise ConfigError("executor.name", name, f"multiproc, ray or auto for {world} workers "
                          "(parallel.tensor_parallel_size * pipeline_parallel_size); uniproc "
                          "runs one")
    if not ex.target and name == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("executor.name", "ray", "", message="got 'ray', but Ray is not "
                              "installed: pip install 'llmkit[ray]' (or executor=multiproc "
                              "on one machine)") from None
    return EXECUTORS.resolve(name, ex.target)


__all__ = ["EXECUTORS", "BackendInfo", "Executor", "ModelFacts", "executor_class"]
