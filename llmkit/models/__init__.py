"""Model implementations, chosen by the Hugging Face architecture name of the checkpoint
(``config.architectures[0]``). Third parties add architectures with the ``llmkit.model`` entry
point group or ``MODELS.register``.
"""
from __future__ import annotations

from llmkit.models.registry import MODELS, UnsupportedModelError, get_model_class


def __getattr__(name: str):
    if name == "CausalLM":
        from llmkit.models.base import CausalLM
        return CausalLM
    raise AttributeError(f"module 'llmkit.models' has no attribute {name!r}")


# The loader (ModelSource, resolve_model_source, build_model) is imported from
# llmkit.models.loader: it builds on this package, which therefore does not re-export it.
__all__ = ["MODELS", "CausalLM", "UnsupportedModelError", "get_model_class"]
