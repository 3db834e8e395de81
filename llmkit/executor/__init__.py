"""Executors, picked by ``executor=NAME``."""
from llmkit.executor.base import BackendInfo, Executor, ModelFacts
from llmkit.registry import Registry

EXECUTORS: Registry[Executor] = Registry("executor")
EXECUTORS.register_lazy("uniproc", "llmkit.executor.uniproc.UniprocExecutor")
# No model: steps priced by a hardware cost model (`llmkit sim`, llmkit/sim/).
EXECUTORS.register_lazy("sim", "llmkit.executor.sim.SimExecutor")

__all__ = ["EXECUTORS", "BackendInfo", "Executor", "ModelFacts"]
