"""Capabilities a model may have beyond ``CausalLM``: vLLM's ``SupportsMultiModal``."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class SupportsMultiModal(ABC):
    """A model whose prompts carry images: an encoder turns an image's pixels into the
    embeddings of its placeholder tokens, which the runner splices into the language model's
    ``inputs_embeds`` (``CausalLM.embed_input_ids`` for the text tokens)."""

    supports_multimodal = True

    @abstractmethod
    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, H, W]`` -> ``[images, tokens_per_image, hidden_size]``: one
        row per placeholder token, in placeholder order."""


def supports_multimodal(model: object) -> bool:
    return isinstance(model, SupportsMultiModal)
