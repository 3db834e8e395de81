"""A chat request's prompt (``/v1/chat/completions``, ``/tokenize`` with ``messages``): the
messages through the model's chat template into token ids, and the images of its content parts
decoded and replaced by the model's placeholder. Bad input is a 400 naming ``messages``.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from llmkit.engine.async_llm import AsyncLLM
from llmkit.entrypoints.openai.errors import bad_request
from llmkit.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage,
                                                TokenizeRequest)
from llmkit.entrypoints.openai.tools import ToolUse, template_messages
from llmkit.multimodal.content_parts import split_image_parts
from llmkit.multimodal.image import ImageError, load_image_url

ChatRequest = ChatCompletionRequest | TokenizeRequest


def render_chat_prompt(tokenizer: Any, req: ChatRequest, use: ToolUse | None,
                       template_has_tools: bool,
                       encode: Callable[..., list[int]]) -> list[int]:
    """The token ids of the request's messages as the chat template renders them
    (``encode(text, param, **kwargs)`` tokenizes, with a 400 for text it cannot take)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions",
                          "messages")
    messages, tool_kwargs = template_messages(req, use or ToolUse("none", []),
                                              native=template_has_tools)
    kwargs = {**tool_kwargs, **dict(getattr(req, "chat_template_kwargs", None) or {})}
    continue_final = getattr(req, "continue_final_message", False)
    add_gen = req.add_generation_prompt and not continue_final
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_gen,
            **({"continue_final_message": True} if continue_final else {}), **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input
        raise bad_request(f"the chat template failed on these messages: {e}",
                          "messages") from None
    ids = encode(text, "messages", add_special_tokens=False)
    if not ids:
        raise bad_request("the conversation is empty (no tokens)", "messages")
    return ids


async def load_chat_images(engine: AsyncLLM, req: ChatRequest) -> tuple[ChatRequest, list]:
    """The request with each image content part replaced by the model's placeholder, and
    the images (decoded here: a bad one is a 400 before the engine sees anything)."""
    if not any(m.has_images for m in req.messages):
        return req, []
    mm = engine.multimodal_processor
    if mm is None:
        raise bad_request("this model takes no images; send text content parts only",
                          "messages")
    cfg = engine.config
    limit = cfg.multimodal.limit("image")
    n = sum(1 for m in req.messages if m.has_images for p in m.content
            if p.get("type") == "image_url")
    if n > limit:
        raise bad_request(f"the conversation has {n} images, more than "
                          f"multimodal.limit_mm_per_prompt.image={limit}", "messages")

    def load(url: str):
        return load_image_url(url, max_bytes=cfg.multimodal.max_image_bytes,
                              allowed_domains=cfg.server.allowed_media_domains)

    try:
        # In a thread: decoding (and fetching from an allowed host) must not stall the
        # event loop that streams other requests.
        messages, images = await asyncio.to_thread(
            split_image_parts, [m.model_dump(exclude_none=True) for m in req.messages],
            mm.placeholder, load)
    except ImageError as e:
        raise bad_request(str(e), "messages") from None
    return req.model_copy(update={"messages": [ChatMessage(**m) for m in messages]}), images
