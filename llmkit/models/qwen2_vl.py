"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``): a vision transformer over images of any size and a
Qwen2 language model with M-RoPE positions.

The language model is ``LlamaForCausalLM`` (the Qwen2 variant: q/k/v biases) built from
``text_config`` with the same ``ModelContext``; its rotary table already rotates by 3 position
rows (``mrope_section``). This file adds the image encoder and each prompt's positions.
"""
from __future__ import annotations

import copy
from typing import Iterable, Sequence

import numpy as np
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.linear.base import copy_weight
from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.interfaces import SupportsMRoPE, SupportsMultiModal
from llmkit.models.llama import LlamaForCausalLM
from llmkit.models.layers.rotary import rope_parameters
from llmkit.models.qwen2_vl_vision import Qwen2VisionTransformer

# Checkpoint name prefixes -> this model's: transformers >= 4.52 saves ``model.visual.*`` and
# ``model.language_model.*``; the released checkpoints have ``visual.*`` and ``model.*``.
_WEIGHT_PREFIXES = (
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.language_model.", "language_model.model."),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


def mrope_input_positions(num_tokens: int, mm_features: Sequence, merge: int
                          ) -> tuple[np.ndarray, int]:
    """Qwen2-VL's ``get_rope_index`` for one prompt: text tokens count up in all 3 rows; an
    image's tokens sit at (start, start + row, start + column) of its merged grid, and the text
    after it continues from ``start + max(rows, columns)``."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cursor, current = 0, 0
    for f in mm_features:
        text = f.offset - cursor
        pos[:, cursor:f.offset] = np.arange(text) + current
        current += text
        t, h, w = (int(v) for v in f.grid_thw)
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, f.offset:f.offset + f.length] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) \
            + current
        current += max(gh, gw)
        cursor = f.offset + f.length
    pos[:, cursor:] = np.arange(num_tokens - cursor) + current
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


class Qwen2VLForConditionalGeneration(CausalLM, SupportsMultiModal, SupportsMRoPE):
    """Also registered for ``Qwen2_5_VLForConditionalGeneration`` (the vision config says
    which vision transformer)."""

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        vc = hf_config.vision_config
        if vc.model_type not in ("qwen2_vl_vision", "qwen2_5_vl_vision"):
            raise ValueError(f"Qwen2-VL vision config {vc.model_type!r} is not supported "
                             "(qwen2_vl_vision, qwen2_5_vl_vision)")
        tc = copy.copy(hf_config.text_config)
        # transformers 5 keeps the tie on the outer config (older saves: on text_config).
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)
                                      or getattr(tc, "tie_word_embeddings", False))
        if not rope_parameters(tc).get("mrope_section"):
            raise ValueError("a Qwen2-VL text config needs rope_parameters.mrope_section")
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(vc.spatial_merge_size)
        # Plain torch modules in the model's dtype (as LLaVA's tower): it runs once per image.
        self.visual = Qwen2VisionTransformer(vc, ctx.dtype, ctx.ops)
        self.language_model = LlamaForCausalLM(tc, ctx)
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

    def embed_multimodal(self, pixel_values: torch.Tensor,
                         grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        if grid_thw is None:
            raise ValueError("Qwen2-VL encodes images with their patch grid (grid_thw)")
        return self.visual(pixel_values.to(self.dtype), tuple(int(v) for v in grid_thw))

    def get_mrope_input_positions(self, num_tokens: int,
                                  mm_features: Sequence) -> tuple[np.ndarray, int]:
        return mrope_input_positions(num_tokens, mm_features, self.spatial_merge_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = {n: p for n, p in self.named_parameters() if n.startswith("visual.")}
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = _rename(name)
                if name.startswith("language_model."):
                    yield name.removeprefix("language_model."), tensor
                    continue
                param = own.get(name)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no counterpart in the "
                                     "model")
                copy_weight(param, tensor, name)
                loaded.add(name)

        self.language_model.load_weights(text_weights())
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of the model: "
                             f"{', '.join(missing[:8])}")


def _rename(name: str) -> str:
    for old, new in _WEIGHT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
