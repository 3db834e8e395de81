"""A chat request's prompt (``/v1/chat/completions``, ``/tokenize`` with ``messages``): the
engine's ``Frontend`` renders the messages and decodes their images; this module turns what it
refuses into a 400 naming ``messages`` and adds the server's own parts (tool prompts,
``chat_template_kwargs``, ``continue_final_message``).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from llmkit.engine.frontend import Frontend
from llmkit.entrypoints.openai.errors import bad_request
from llmkit.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage,
                                                TokenizeRequest)
from llmkit.entrypoints.openai.tools import ToolUse, template_messages

ChatRequest = ChatCompletionRequest | TokenizeRequest


def render_chat_prompt(frontend: Frontend, req: ChatRequest, use: ToolUse | None,
                       template_has_tools: bool,
                       encode: Callable[..., list[int]]) -> list[int]:
    """The token ids of the request's messages as the chat template renders them
    (``encode(text, param, **kwargs)`` tokenizes, with a 400 for text it cannot take)."""
    if not frontend.has_chat_template:
        raise bad_request("this model has no chat template; use /v1/completions",
                          "messages")
    messages, tool_kwargs = template_messages(req, use or ToolUse("none", []),
                                              native=template_has_tools)
    is_chat = isinstance(req, ChatCompletionRequest)  # /tokenize has no template options
    kwargs = {**tool_kwargs, **dict((req.chat_template_kwargs if is_chat else None) or {})}
    continue_final = is_chat and req.continue_final_message
    add_gen = req.add_generation_prompt and not continue_final
    try:
        text = frontend.render_chat(messages, add_generation_prompt=add_gen,
                                    continue_final_message=continue_final, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input
        raise bad_request(f"the chat template failed on these messages: {e}",
                          "messages") from None
    ids = encode(text, "messages", add_special_tokens=False)
    if not ids:
        raise bad_request("the conversation is empty (no tokens)", "messages")
    return ids


async def load_chat_images(frontend: Frontend, req: ChatRequest) -> tuple[ChatRequest, list]:
    """The request with each image content part replaced by the model's placeholder, and
    the images (decoded here: a bad one is a 400 before the engine sees anything)."""
    if not any(m.has_images for m in req.messages):
        return req, []
    try:
        # In a thread: decoding (and fetching from an allowed host) must not stall the
        # event loop that streams other requests.
        messages, images = await asyncio.to_thread(
            frontend.split_images, [m.model_dump(exclude_none=True) for m in req.messages])
    except ValueError as e:  # ImageError, and the frontend's limits
        raise bad_request(str(e), "messages") from None
    return req.model_copy(update={"messages": [ChatMessage(**m) for m in messages]}), images
