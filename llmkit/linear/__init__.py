"""Linear methods: how linear layers store and multiply their weights (``base.py``), picked per
layer by the platform, or by ``model.linear_method`` (a registered name or a class path)."""
from llmkit.linear.base import LinearMethod, LinearMethodFactory, LinearSpec, copy_weight
from llmkit.registry import Registry

LINEAR_METHODS: Registry[LinearMethod] = Registry("linear_method")
LINEAR_METHODS.register_lazy("torch", "llmkit.linear.torch_linear.TorchLinearMethod")
# the CPU method without the C++ kernels (oneDNN-packed / MKL); `auto` adds the kernels
LINEAR_METHODS.register_lazy("cpu", "llmkit.linear.cpu_linear.CpuLinearMethod")

__all__ = ["LINEAR_METHODS", "LinearMethod", "LinearMethodFactory", "LinearSpec", "copy_weight"]
