"""Executors, picked by ``executor=NAME``."""
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.registry import Registry

EXECUTORS: Registry[Executor] = Registry("executor")
EXECUTORS.register_lazy("uniproc", "llmkit.executor.uniproc.UniprocExecutor")
# `sim` (no model: steps priced by a hardware cost model, llmkit/sim/executor.py) registers
# itself through the `llmkit.executor` entry point group (pyproject.toml).

__all__ = ["EXECUTORS", "BackendInfo", "Executor", "ModelFacts"]
