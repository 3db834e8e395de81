"""What building a worker's model takes, shared by every executor's workers: the dtype, the
linear methods ``model.linear_method`` / ``model.quantization`` ask for, and the backend's
description."""
from __future__ import annotations

import logging

import torch

from llmkit.config.errors import ConfigError
from llmkit.facts import BackendInfo
from llmkit.kernels.kv_quant import FORMATS as KV_QUANT_FORMATS
from llmkit.linear import LINEAR_METHODS, LinearMethodFactory
from llmkit.models.layers.linear import Linear
from llmkit.models.layers.moe import FusedMoE
from llmkit.platforms.base import Platform
from llmkit.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    return platform.preferred_dtype() if name == "auto" else _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``kv_cache.cache_dtype`` as the pool tensor's dtype: the model's for ``auto``, a float
    type, or a quantized format's storage (``int8`` codes; e4m3 codes held as ``uint8``)."""
    if name == "auto":
        return model_dtype
    if name in _DTYPES:
        return _DTYPES[name]
    return KV_QUANT_FORMATS["fp8_e4m3" if name == "fp8" else name].storage_dtype


def linear_method_factory(model_config, platform: Platform, dtype: torch.dtype,
                          quantization: str = "none") -> tuple[LinearMethodFactory, str]:
    """``model.linear_method``: ``auto`` is the platform's choice per layer; a registered name
    or a class path (``_target_`` style) is one method class, instantiated per layer.

    ``quantization`` (resolved ``model.quantization``) other than none asks the platform for
    its quantized methods; where it has none, or a method was forced, ``model.quantization=
    auto`` dequantizes with a warning and an explicit one fails. Returns the factory and the
    quantization it runs."""
    choice = model_config.linear_method
    if quantization != "none":
        why = (f"model.linear_method={choice} is a float method" if choice != "auto"
               else platform.quantized_linear_method_factory(dtype, quantization))
        if not isinstance(why, str):
            return why, quantization
        if model_config.quantization != "auto":
            raise ConfigError("model.quantization", model_config.quantization, "", message=(
                f"got {model_config.quantization!r}, but {why}; use model.quantization=none"))
        logger.warning("model.quantization=auto: the checkpoint is quantized (%s) but %s; "
                       "dequantizing it to %s", quantization, why,
                       str(dtype).removeprefix("torch."))
    if choice == "auto":
        return platform.linear_method_factory(dtype), "none"
    cls = LINEAR_METHODS.resolve(None, choice) if "." in choice else LINEAR_METHODS.get(choice)
    return (lambda spec: cls()), "none"


def describe_backend(runner: ModelRunner, attention: str, ops: str, dtype: torch.dtype,
                     platform: Platform) -> BackendInfo:
    """What computes: the attention backend, the op set, the linear methods the model's layers
    took, and the step graphs."""
    methods = sorted({m.method.describe() for m in runner.model.modules()
                      if isinstance(m, Linear)}
                     | {m.describe() for m in runner.model.modules() if isinstance(m, FusedMoE)})
    pending = runner.pending_graphs
    graphs = runner.step_graphs or (pending.graphs if pending is not None else None)
    return BackendInfo(attention=attention, ops=ops, linear_methods=tuple(methods),
                       dtype=str(dtype).removeprefix("torch."), device=str(platform.device),
                       step_graphs=graphs.name if graphs is not None else None,
                       step_graphs_max_rows=graphs.max_rows if graphs is not None else 0,
                       step_graphs_pending=pending is not None,
                       isa=platform.isa if ops != "torch" else None)
