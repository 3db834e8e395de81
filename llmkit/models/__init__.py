"""Model implementations, chosen by the Hugging Face architecture name of the checkpoint
(``config.architectures[0]``). Third parties add architectures with the ``llmkit.model`` entry
point group or ``MODELS.register``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.registry import Registry

if TYPE_CHECKING:
    from llmkit.models.base import CausalLM

MODELS: Registry["CausalLM"] = Registry("model")
for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    MODELS.register_lazy(_arch, "llmkit.models.llama.LlamaForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no implementation; the message lists those that do."""


def get_model_class(hf_config) -> type["CausalLM"]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODELS:
            return MODELS.get(arch)
    what = ", ".join(archs) if archs else f"none given (model_type {hf_config.model_type!r})"
    raise UnsupportedModelError(
        f"model architecture {what} is not supported; supported architectures: "
        f"{', '.join(MODELS.names())}")


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
