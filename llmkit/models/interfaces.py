"""Capabilities a model may have beyond ``CausalLM``: vLLM's ``SupportsMultiModal`` and
``SupportsMRoPE``."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import torch


class SupportsMultiModal(ABC):
    """A model whose prompts carry images: an encoder turns an image's pixels into the
    embeddings of its placeholder tokens, which the runner splices into the language model's
    ``inputs_embeds`` (``CausalLM.embed_input_ids`` for the text tokens)."""

    supports_multimodal = True
    #: Placeholder tokens per image when every image has the same number (LLaVA); None: it
    #: follows the image's size (Qwen2-VL).
    num_image_tokens: int | None = None

    @abstractmethod
    def embed_multimodal(self, pixel_values: torch.Tensor,
                         grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``pixel_values`` of images of one shape (the runner groups them; ``[images,
        channels, H, W]`` for a fixed-size encoder, ``[images, patches, patch_dim]`` with the
        patch grid ``grid_thw`` for a variable-size one) -> ``[images, tokens_per_image,
        hidden_size]``: one row per placeholder token, in placeholder order."""


def supports_multimodal(model: object) -> bool:
    return isinstance(model, SupportsMultiModal)


class SupportsMRoPE(ABC):
    """A model whose rotary positions are 3 per token (Qwen2-VL's M-RoPE: temporal, height,
    width): an image token's follow its place in the image's grid, text positions continue from
    the largest before them. The runner computes a prompt's positions once (when the request
    is added, again after preemption) and slices them per step, so chunked prefill and prefix
    hits read the same positions; tokens after the prompt are at ``index + delta`` in all 3
    sections."""

    supports_mrope = True

    @abstractmethod
    def get_mrope_input_positions(self, num_tokens: int,
                                  mm_features: Sequence) -> tuple[np.ndarray, int]:
        """``(positions int64 [3, num_tokens], delta)`` of a prompt of ``num_tokens`` whose
        images are ``mm_features`` (``MultiModalFeatureSpec``, by offset)."""


def supports_mrope(model: object) -> bool:
    return isinstance(model, SupportsMRoPE)
