"""Executors, picked by ``executor=NAME``."""
from llmkit.executor.base import Executor, ModelFacts
from llmkit.registry import Registry

EXECUTORS: Registry[Executor] = Registry("executor")
EXECUTORS.register_lazy("uniproc", "llmkit.executor.uniproc.UniprocExecutor")

__all__ = ["EXECUTORS", "Executor", "ModelFacts"]
