"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``): a vision transformer over images of any size and a
Qwen2 language model with M-RoPE positions.

The language model is ``LlamaForCausalLM`` (the Qwen2 variant: q/k/v biases) built from
``text_config`` with the same ``ModelContext``; its rotary table already rotates by 3 position
rows (``mrope_section``). This file adds the image encoder and each prompt's positions.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch

from llmkit.models.base import ModelContext
from llmkit.models.interfaces import SupportsMRoPE
from llmkit.models.layers.rotary import rope_parameters
from llmkit.models.qwen2_vl_vision import Qwen2VisionTransformer
from llmkit.models.vision_language import VisionLanguageModel

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


class Qwen2VLForConditionalGeneration(VisionLanguageModel, SupportsMRoPE):
    """Also registered for ``Qwen2_5_VLForConditionalGeneration`` (the vision config says
    which vision transformer)."""

    weight_prefixes = _WEIGHT_PREFIXES

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
        self._build_language_model(tc, ctx)

    def embed_multimodal(self, pixel_values: torch.Tensor,
                         grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        if grid_thw is None:
            raise ValueError("Qwen2-VL encodes images with their patch grid (grid_thw)")
        return self.visual(pixel_values.to(self.dtype), tuple(int(v) for v in grid_thw))

    def get_mrope_input_positions(self, num_tokens: int,
                                  mm_features: Sequence) -> tuple[np.ndarray, int]:
        return mrope_input_positions(num_tokens, mm_features, self.spatial_merge_size)
