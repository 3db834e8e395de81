"""OpenAI chat content parts with images: ``{"type": "image_url", "image_url": {"url": ...}}``
(and llmkit's offline form ``{"type": "image_pil", "image_pil": PIL.Image}``, as vLLM's).

A message's parts become one string for the chat template — each image part replaced by the
model's placeholder (``<image>``) where it stood — and the images, in order, for
``multi_modal_data``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from PIL import Image

from llmkit.multimodal.image import ImageError

__all__ = ["IMAGE_PART_TYPES", "split_image_parts"]

IMAGE_PART_TYPES = ("image_url", "image_pil")


def split_image_parts(messages: Sequence[Mapping[str, Any]], placeholder: str | None,
                      load_url: Callable[[str], Image.Image]
                      ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """``(messages with string contents, images)``. ``placeholder`` None: the model takes no
    images, and an image part is an ``ImageError``."""
    out: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        texts: list[str] = []
        for i, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                texts.append(part["text"])
                continue
            if kind not in IMAGE_PART_TYPES:
                raise ImageError(f"content part {i}: type {kind!r} is not supported (text, "
                                 "image_url)")
            if placeholder is None:
                raise ImageError("this model takes no images; send text content parts only")
            if kind == "image_pil":
                image = part["image_pil"]
                if not isinstance(image, Image.Image):
                    raise ImageError(f"content part {i}: image_pil must be a PIL image")
            else:
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, Mapping) else spec
                if not isinstance(url, str):
                    raise ImageError(f"content part {i}: image_url.url must be a string")
                image = load_url(url)
            images.append(image)
            texts.append(placeholder)
        out.append({**m, "content": "".join(texts)})
    return out, images
