"""The multimodal processor (vLLM's ``BaseMultiModalProcessor``): a prompt's token ids and its
images in; the token ids with each image placeholder expanded to the model's number of image
tokens, and one ``MultiModalFeatureSpec`` per image, out — before the engine schedules
anything, so the scheduler, the KV budget and the prefix cache see image tokens as tokens.

The image processor (resize, crop, normalize) is the model folder's own
(``preprocessor_config.json`` / ``processor_config.json``), read with transformers' auto class,
never from a hub.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from llmkit.multimodal.base import MultiModalFeatureSpec
from llmkit.multimodal.hashing import hash_image

__all__ = ["MultiModalProcessor", "multimodal_processor_for"]

logger = logging.getLogger(__name__)

# model_type -> how to read (placeholder token id, tokens per image) from its config.
_LLAVA_TYPES = ("llava",)


class MultiModalProcessor:
    def __init__(self, image_processor: Any, image_token_id: int, image_token: str,
                 num_image_tokens: int, *, limit_per_prompt: int) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        # The placeholder as prompt text: chat templates and content parts insert it.
        self.image_token = image_token
        self.num_image_tokens = num_image_tokens
        self.limit_per_prompt = limit_per_prompt

    def process(self, token_ids: Sequence[int],
                images: Sequence[Image.Image]) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Expand the prompt's ``<image>`` placeholders (one per image, in order); raise
        ``ValueError`` when their number does not match the images given."""
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"the prompt has {len(images)} images, more than "
                             f"multimodal.limit_mm_per_prompt.image={self.limit_per_prompt}")
        tid = self.image_token_id
        num_placeholders = sum(1 for t in token_ids if t == tid)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} image placeholder(s) "
                             f"({self.image_token!r}) but {len(images)} image(s) were given")
        for image in images:
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'] must be PIL images, got "
                                 f"{type(image).__name__}")
        if not images:
            return list(token_ids), []
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        pixels = np.asarray(self.image_processor(images=rgb, return_tensors="np")
                            ["pixel_values"], dtype=np.float32)
        out: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        n = self.num_image_tokens
        for t in token_ids:
            if t != tid:
                out.append(t)
                continue
            i = len(features)
            features.append(MultiModalFeatureSpec.from_array(hash_image(rgb[i]), len(out), n,
                                                             pixels[i:i + 1]))
            out.extend([tid] * n)
        return out, features


def multimodal_processor_for(path: Path, hf_config: Any, tokenizer: Any,
                             limit_per_prompt: int) -> MultiModalProcessor | None:
    """The processor of a multimodal model folder; ``None`` for a text-only model."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LLAVA_TYPES:
        return None
    from transformers import AutoImageProcessor

    from llmkit.models.llava import llava_num_image_tokens

    image_processor = AutoImageProcessor.from_pretrained(str(path))
    tid = getattr(hf_config, "image_token_id", None)
    tid = int(hf_config.image_token_index if tid is None else tid)
    token = tokenizer.convert_ids_to_tokens(tid)
    return MultiModalProcessor(image_processor, tid, token, llava_num_image_tokens(hf_config),
                               limit_per_prompt=limit_per_prompt)
