"""The multimodal processor (vLLM's ``BaseMultiModalProcessor``): a prompt's token ids and its
images in; the token ids with each image placeholder expanded to the image's number of tokens,
and one ``MultiModalFeatureSpec`` per image, out — before the engine schedules anything, so the
scheduler, the KV budget and the prefix cache see image tokens as tokens.

The image processor (resize, crop, normalize, patchify) is the model folder's own
(``preprocessor_config.json`` / ``processor_config.json``), read with transformers' auto class,
never from a hub. Two kinds of encoder: a fixed-size one (LLaVA's CLIP: every image is resized
to one crop, a fixed number of tokens) and a patch-grid one (Qwen2-VL: the image is resized
within ``min_pixels``/``max_pixels`` to a multiple of the patch, so its number of tokens
depends on its size).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from llmkit.multimodal.base import MultiModalFeatureSpec
from llmkit.multimodal.hashing import hash_image

__all__ = ["EncoderInput", "GridImageProcessor", "MultiModalProcessor",
           "multimodal_processor_for"]

logger = logging.getLogger(__name__)

_LLAVA_TYPES = ("llava",)
_QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(slots=True)
class EncoderInput:
    """One image's encoder input (a leading axis of 1), its number of tokens and patch grid."""

    pixels: np.ndarray
    num_tokens: int
    grid_thw: tuple[int, ...] = ()


class MultiModalProcessor:
    """A fixed-size encoder's processor (LLaVA): ``num_image_tokens`` per image. Subclasses
    override ``encode`` and ``num_tokens`` for encoders whose images vary in size."""

    def __init__(self, image_processor: Any, image_token_id: int, image_token: str,
                 num_image_tokens: int, *, limit_per_prompt: int,
                 placeholder: str | None = None) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        # The token each image's tokens expand from.
        self.image_token = image_token
        # An image as prompt text (chat content parts become it): the image token, or the
        # model's framing of it (Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>).
        self.placeholder = placeholder or image_token
        self.num_image_tokens = num_image_tokens
        self.limit_per_prompt = limit_per_prompt

    def num_tokens(self, image: Image.Image) -> int:
        """How many tokens ``image`` takes in the prompt (without processing its pixels)."""
        return self.num_image_tokens

    def encode(self, images: Sequence[Image.Image]) -> list[EncoderInput]:
        pixels = np.asarray(self.image_processor(images=list(images), return_tensors="np")
                            ["pixel_values"], dtype=np.float32)
        return [EncoderInput(pixels[i:i + 1], self.num_image_tokens)
                for i in range(len(images))]

    def expand(self, token_ids: Sequence[int], images: Sequence[Image.Image]) -> list[int]:
        """The prompt's ids as the engine sees them (each image token expanded to its image's
        tokens) without encoding any pixels: what ``/tokenize`` counts."""
        self._check(token_ids, images)
        counts = iter([self.num_tokens(im) for im in images])
        out: list[int] = []
        for t in token_ids:
            out.extend([t] * next(counts) if t == self.image_token_id else (t,))
        return out

    def process(self, token_ids: Sequence[int],
                images: Sequence[Image.Image]) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Expand the prompt's image tokens (one per image, in order); raise ``ValueError``
        when their number does not match the images given."""
        self._check(token_ids, images)
        if not images:
            return list(token_ids), []
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        inputs = self.encode(rgb)
        tid = self.image_token_id
        out: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        for t in token_ids:
            if t != tid:
                out.append(t)
                continue
            i = len(features)
            e = inputs[i]
            features.append(MultiModalFeatureSpec.from_array(
                hash_image(rgb[i]), len(out), e.num_tokens, e.pixels, grid_thw=e.grid_thw))
            out.extend([tid] * e.num_tokens)
        return out, features

    def _check(self, token_ids: Sequence[int], images: Sequence[Image.Image]) -> None:
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"the prompt has {len(images)} images, more than "
                             f"multimodal.limit_mm_per_prompt.image={self.limit_per_prompt}")
        tid = self.image_token_id
        num_placeholders = sum(1 for t in token_ids if t == tid)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} image placeholder(s) "
                             f"({self.placeholder!r}) but {len(images)} image(s) were given")
        for image in images:
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'] must be PIL images, got "
                                 f"{type(image).__name__}")


class GridImageProcessor(MultiModalProcessor):
    """Qwen2-VL's: an image becomes ``t*h*w`` patches (``image_grid_thw``) and
    ``t*h*w / merge_size²`` tokens."""

    def __init__(self, image_processor: Any, image_token_id: int, image_token: str, *,
                 limit_per_prompt: int, placeholder: str | None = None) -> None:
        super().__init__(image_processor, image_token_id, image_token, 0,
                         limit_per_prompt=limit_per_prompt, placeholder=placeholder)
        self.merge_size = int(image_processor.merge_size)

    def num_tokens(self, image: Image.Image) -> int:
        w, h = image.size
        return int(self.image_processor.get_number_of_image_patches(h, w, {})) \
            // self.merge_size ** 2

    def encode(self, images: Sequence[Image.Image]) -> list[EncoderInput]:
        out = self.image_processor(images=list(images), return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = np.asarray(out["image_grid_thw"]).tolist()
        inputs, start = [], 0
        for grid in grids:
            n = int(np.prod(grid))
            inputs.append(EncoderInput(pixels[None, start:start + n],
                                       n // self.merge_size ** 2, tuple(grid)))
            start += n
        return inputs


def multimodal_processor_for(path: Path, hf_config: Any, tokenizer: Any,
                             limit_per_prompt: int) -> MultiModalProcessor | None:
    """The processor of a multimodal model folder; ``None`` for a text-only model."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LLAVA_TYPES + _QWEN2_VL_TYPES:
        return None
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(str(path))
    tid = getattr(hf_config, "image_token_id", None)
    if model_type in _QWEN2_VL_TYPES:
        tid = int(tid)
        start = tokenizer.convert_ids_to_tokens(int(hf_config.vision_start_token_id))
        end = tokenizer.convert_ids_to_tokens(int(hf_config.vision_end_token_id))
        token = tokenizer.convert_ids_to_tokens(tid)
        return GridImageProcessor(image_processor, tid, token,
                                  limit_per_prompt=limit_per_prompt,
                                  placeholder=f"{start}{token}{end}")
    from llmkit.models.llava import llava_num_image_tokens

    tid = int(hf_config.image_token_index if tid is None else tid)
    token = tokenizer.convert_ids_to_tokens(tid)
    return MultiModalProcessor(image_processor, tid, token, llava_num_image_tokens(hf_config),
                               limit_per_prompt=limit_per_prompt)
