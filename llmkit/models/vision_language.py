"""A vision-language model: an image encoder in front of a ``LlamaForCausalLM``.

LLaVA and Qwen2-VL differ in their encoders and checkpoint names only; the language model
(built from ``text_config`` with the same ``ModelContext``, so it runs the forward every text
model runs) and the routing of checkpoint weights between it and the encoder are the same,
and live here once.
"""
from __future__ import annotations

from typing import Iterable

import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.linear.base import copy_weight
from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.interfaces import SupportsMultiModal
from llmkit.models.llama import LlamaForCausalLM, raise_if_missing

_LM_PREFIX = "language_model."


class VisionLanguageModel(CausalLM, SupportsMultiModal):
    """The language model's forward, token embeddings and logits are this model's; a subclass
    builds its encoder, calls :meth:`_build_language_model` and implements
    ``embed_multimodal``."""

    supports_kv_layer_hook = True  # the language model's layer loop calls it (LLaVA, Qwen2-VL)
    #: Checkpoint name prefixes -> this model's (the first that matches renames a weight):
    #: transformers versions save the same model under different prefixes.
    weight_prefixes: tuple[tuple[str, str], ...] = ()

    def _build_language_model(self, text_config, ctx: ModelContext) -> None:
        self.language_model = LlamaForCausalLM(text_config, ctx)
        lm = self.language_model
        self.num_layers, self.num_heads = lm.num_layers, lm.num_heads
        self.num_kv_heads, self.head_dim = lm.num_kv_heads, lm.head_dim
        self.hidden_size, self.vocab_size = lm.hidden_size, lm.vocab_size

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, attn_metadata,
                                   inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def _rename_weight(self, name: str) -> str:
        for old, new in self.weight_prefixes:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def _encoder_weight_name(self, name: str) -> str | None:
        """The parameter a (renamed) checkpoint weight outside the language model loads, or
        None for one the model never reads."""
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = {n: p for n, p in self.named_parameters() if not n.startswith(_LM_PREFIX)}
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = self._rename_weight(name)
                if name.startswith(_LM_PREFIX):
                    yield name.removeprefix(_LM_PREFIX), tensor
                    continue
                name = self._encoder_weight_name(name)
                if name is None:
                    continue
                param = own.get(name)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no counterpart in the "
                                     "model")
                copy_weight(param, tensor, name)
                loaded.add(name)

        self.language_model.load_weights(text_weights())
        raise_if_missing({(n, None) for n in own}, {(n, None) for n in loaded})
