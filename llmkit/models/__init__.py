"""Model implementations, chosen by the Hugging Face architecture name of the checkpoint
(``config.architectures[0]``). Third parties add architectures with the ``llmkit.model`` entry
point group or ``MODELS.register``.
"""
from __future__ import annotations

from llmkit.models.registry import MODELS, UnsupportedModelError, get_model_class


def __getattr__(name: str):
    # Light package import: the loader (transformers, gguf) loads on first use.
    if name in ("ModelSource", "resolve_model_source", "build_model"):
        from llmkit.models import loader
        return getattr(loader, name)
    if name == "CausalLM":
        from llmkit.models.base import CausalLM
        return CausalLM
    raise AttributeError(f"module 'llmkit.models' has no attribute {name!r}")


__all__ = ["MODELS", "CausalLM", "ModelSource", "UnsupportedModelError", "build_model",
           "get_model_class", "resolve_model_source"]
