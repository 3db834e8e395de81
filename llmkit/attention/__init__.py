"""Attention backends, picked by ``attention=NAME``; ``auto`` lets the platform choose
(``triton`` on CUDA, ``cpu`` on the CPU)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.registry import Registry

if TYPE_CHECKING:
    from llmkit.config.schema import AttentionConfig
    from llmkit.platforms.base import Platform

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention")
ATTENTION_BACKENDS.register_lazy("torch", "llmkit.attention.torch_backend.TorchAttentionBackend")
ATTENTION_BACKENDS.register_lazy("cpu", "llmkit.attention.cpu_backend.CpuAttentionBackend")
ATTENTION_BACKENDS.register_lazy("triton",
                                 "llmkit.attention.triton_backend.TritonAttentionBackend")
AUTO = "auto"


def attention_backend_class(config: "AttentionConfig", platform: "Platform") -> type[AttentionBackend]:
    """The backend a config names; ``auto`` is the platform's default."""
    name = platform.default_attention if config.name == AUTO and not config.target else config.name
    return ATTENTION_BACKENDS.resolve(name, config.target)


__all__ = ["ATTENTION_BACKENDS", "AUTO", "AttentionBackend", "AttentionMetadata",
           "attention_backend_class"]
