"""The model registry: Hugging Face architecture name -> implementation class (lazy)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.registry import Registry

if TYPE_CHECKING:
    from llmkit.models.base import CausalLM

MODELS: Registry["CausalLM"] = Registry("model")
for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    MODELS.register_lazy(_arch, "llmkit.models.llama.LlamaForCausalLM")
for _arch in ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"):  # embedding models
    MODELS.register_lazy(_arch, "llmkit.models.llama_embedding.LlamaEmbeddingModel")
MODELS.register_lazy("BertModel", "llmkit.models.bert.BertModel")  # an encoder: pooling only
for _arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
    MODELS.register_lazy(_arch, "llmkit.models.moe.MoeForCausalLM")
for _arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
    MODELS.register_lazy(_arch, f"llmkit.models.deepseek.{_arch}")
MODELS.register_lazy("Gemma2ForCausalLM", "llmkit.models.gemma2.Gemma2ForCausalLM")
MODELS.register_lazy("Gemma3ForCausalLM", "llmkit.models.gemma3.Gemma3ForCausalLM")
MODELS.register_lazy("LlavaForConditionalGeneration",
                     "llmkit.models.llava.LlavaForConditionalGeneration")
for _arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
    MODELS.register_lazy(_arch, "llmkit.models.qwen2_vl.Qwen2VLForConditionalGeneration")
MODELS.register_lazy("BambaForCausalLM", "llmkit.models.bamba.BambaForCausalLM")


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
