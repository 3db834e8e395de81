"""Decoder embedding checkpoints saved from a bare base model (``Qwen3Model``, ``LlamaModel``,
...; ``model.runner=auto`` pools them): the Llama-family forward, weights named without the
``model.`` prefix, and no output head (the pooling engine computes no logits)."""
from __future__ import annotations

import copy
from typing import Iterable

import torch

from llmkit.models.base import ModelContext
from llmkit.models.llama import LlamaForCausalLM


class LlamaEmbeddingModel(LlamaForCausalLM):
    """Registered for ``LlamaModel``, ``MistralModel``, ``Qwen2Model`` and ``Qwen3Model``."""

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model") -> None:
        # The checkpoint has no head: the head is the embedding matrix (tied), never used.
        hf_config = copy.copy(hf_config)
        hf_config.tie_word_embeddings = True
        super().__init__(hf_config, ctx, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name if name.startswith("model.") else f"model.{name}", t)
                             for name, t in weights)
