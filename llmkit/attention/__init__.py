"""Attention backends, picked by ``attention=NAME``."""
from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.registry import Registry

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention")
ATTENTION_BACKENDS.register_lazy("torch", "llmkit.attention.torch_backend.TorchAttentionBackend")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata"]
