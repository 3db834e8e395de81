"""Multimodal inputs: images in prompts (vLLM's ``multi_modal_data``), their placeholders,
content hashes and encoder inputs."""
from llmkit.multimodal.base import MultiModalFeatureSpec, PlaceholderRange

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange"]
