"""``Frontend``: the one place a user's request becomes engine requests and the engine's tokens
become text again. ``LLM`` (in process), ``AsyncLLM`` (the server's engine) and the OpenAI
layer all go through it, so a prompt, a chat or a sampling default means the same in each:

- the model's side (``FrontendModel.load``): its tokenizer and recommended sampling defaults;
- prompts: tokenized and checked against the engine's ``ModelFacts`` (``InputProcessor``);
- chats: the model's chat template (``render_chat``, ``apply_chat_template``) and the images of
  content parts, decoded under the config's limits and replaced by the model's placeholder
  (``split_images``, ``chat_prompt``);
- defaults: ``sampling_params=None`` is the model's defaults (``sampling_params``);
- ``n > 1``: fanned out into engine requests ``"{i}_{id}"`` with seeds ``seed + i``, and their
  outputs merged back, detokenized and stop strings matched (``OutputProcessor``).

Which engine runs the requests, and how they reach it, is the callers' business
(``llmkit.engine.client``).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from llmkit.config.schema import EngineConfig, ModelConfig
from llmkit.engine.input_processor import (InputProcessor, ProcessedPrompt, PromptType,
                                           build_input_processor)
from llmkit.engine.output_processor import OutputProcessor, RequestOutputKind
from llmkit.facts import ModelFacts
from llmkit.models.generation_config import default_sampling_fields, describe_defaults
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.models.pooling_config import PoolingSpec, resolve_pooling
from llmkit.outputs import EmbeddingRequestOutput, EngineCoreOutput, RequestOutput
from llmkit.sampling.params import SamplingParams
from llmkit.startup import startup_step

__all__ = ["Frontend", "FrontendModel", "Message"]

Message = Mapping[str, Any]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class FrontendModel:
    """What the front end reads of the model before the engine is ready: its files, its
    tokenizer and its recommended sampling defaults (vLLM's ``generation_config``)."""

    source: ModelSource
    tokenizer: Any
    default_sampling_fields: dict[str, Any]

    @classmethod
    def load(cls, model_config: ModelConfig) -> "FrontendModel":
        with startup_step("reading the model's config and tokenizer"):
            source = resolve_model_source(model_config)
            tokenizer = source.load_tokenizer()
        defaults = default_sampling_fields(model_config, source.path)
        logger.info("%s", describe_defaults(model_config, defaults))
        return cls(source, tokenizer, defaults)


class Frontend:
    """The request side every entry point shares (see the module docstring). ``facts``: the
    engine's own (``EngineCore.model_facts``, or what the engine process reported when ready),
    which every prompt is checked against. ``outputs``: the output processor, when the caller
    needed it before the engine was ready (``AsyncLLM`` routes the engine's messages from the
    moment its reader thread starts)."""

    def __init__(self, config: EngineConfig, model: FrontendModel, facts: ModelFacts, *,
                 outputs: OutputProcessor | None = None) -> None:
        self.config = config
        self.model_source = model.source
        self.tokenizer = model.tokenizer
        self.default_sampling_fields = model.default_sampling_fields
        self.facts = facts
        self.inputs: InputProcessor = build_input_processor(model.source, model.tokenizer,
                                                            facts, config)
        self.outputs = outputs if outputs is not None else OutputProcessor(model.tokenizer)
        #: model.runner=pooling: how a prompt becomes its embedding; None: the engine generates
        self.pooling: PoolingSpec | None = resolve_pooling(config.model, model.source)

    @property
    def mm_processor(self) -> Any:
        """The model's ``llmkit.multimodal.MultiModalProcessor``; None: text only."""
        return self.inputs.mm_processor

    # -- defaults ---------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """The model's recommended defaults over ``SamplingParams``' own."""
        return SamplingParams(**self.default_sampling_fields)

    def sampling_params(self, params: SamplingParams | None,
                        n: int | None = None) -> SamplingParams:
        """``params``, or the model's defaults when None; ``n`` overrides ``params.n``."""
        params = params or self.default_sampling_params()
        if n is not None and n != params.n:
            params = dataclasses.replace(params, n=n)
        return params

    # -- chats ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The conversation's text as the model's chat template writes it (``ValueError``
        when the model has none; the template's own errors pass through)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        if continue_final_message:  # only templates that know it are handed the keyword
            template_kwargs["continue_final_message"] = True
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **template_kwargs)

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True, **template_kwargs: Any
                            ) -> list[int]:
        """The prompt token ids of a conversation (text contents), by the chat template."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def split_images(self, messages: Sequence[Message]
                     ) -> tuple[list[dict[str, Any]], list[Any]]:
        """``(messages with string contents, images)``: each image content part (``image_url``
        with a data: URL or an allowed host's http(s) URL, ``image_pil``) decoded and replaced
        by the model's placeholder where it stood. Raises ``ImageError`` (a ``ValueError``) for
        a model without images, more images than ``multimodal.limit_mm_per_prompt``, or an
        image that cannot be read. Blocking (it may fetch): servers call it in a thread."""
        from llmkit.multimodal.content_parts import IMAGE_PART_TYPES, split_image_parts
        from llmkit.multimodal.image import ImageError, load_image_url

        num_images = sum(1 for m in messages if isinstance(m.get("content"), list)
                         for p in m["content"] if p.get("type") in IMAGE_PART_TYPES)
        if not num_images:
            return [dict(m) for m in messages], []
        mm = self.mm_processor
        if mm is None:
            raise ImageError("this model takes no images; send text content parts only")
        cfg = self.config
        limit = cfg.multimodal.limit("image")
        if num_images > limit:  # before fetching any of them
            raise ImageError(f"the conversation has {num_images} images, more than "
                             f"multimodal.limit_mm_per_prompt.image={limit}")

        def load(url: str):
            return load_image_url(url, max_bytes=cfg.multimodal.max_image_bytes,
                                  allowed_domains=cfg.server.allowed_media_domains)

        return split_image_parts(messages, mm.placeholder, load)

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> PromptType:
        """A conversation's prompt: its token ids, or with image content parts a dict prompt
        with ``multi_modal_data``."""
        plain, images = self.split_images(messages)
        ids = self.apply_chat_template(plain, add_generation_prompt, **template_kwargs)
        if not images:
            return ids
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    # -- requests ---------------------------------------------------------------------------
    def process(self, prompt: PromptType, params: SamplingParams, *,
                cache_salt: str | None = None) -> ProcessedPrompt:
        """The prompt validated and its parameters completed (``InputProcessor.process``)."""
        if self.pooling is not None:
            raise ValueError("this engine computes embeddings (model.runner=pooling); use "
                             "embed() or /v1/embeddings, or serve with model.runner=generate")
        return self.inputs.process(prompt, params, cache_salt=cache_salt)

    def process_embedding(self, prompt: PromptType, *,
                          cache_salt: str | None = None) -> ProcessedPrompt:
        """A prompt to embed, validated: a pooling request (prefill only; it finishes with
        its prompt's embedding, ``EmbeddingRequestOutput``)."""
        if self.pooling is None:
            raise ValueError("this engine generates (model.runner resolved to generate for "
                             f"{self.model_source.architecture}); embeddings need "
                             "model.runner=pooling")
        p = self.inputs.process(prompt, SamplingParams(max_tokens=1), cache_salt=cache_salt)
        budget = self.config.scheduler.max_num_batched_tokens
        if self.pooling.bidirectional and len(p.token_ids) > budget:
            raise ValueError(f"the prompt has {len(p.token_ids)} tokens; this encoder computes a "
                             f"prompt in one step (never in chunks), at most "
                             f"scheduler.max_num_batched_tokens={budget}")
        return p

    def fan_out(self, request_id: str, prompt: ProcessedPrompt, output_kind: RequestOutputKind,
                prompt_text: str | None = None) -> list[tuple[str, SamplingParams]]:
        """Follow user request ``request_id``; the engine requests to add for it, ``(id,
        params)`` per sample (one with the same id when ``n == 1``). ``prompt_text``: the text
        its outputs report, when not the prompt's own."""
        text = prompt.text if prompt_text is None else prompt_text
        return self.outputs.add_request(request_id, text, prompt.token_ids, prompt.params,
                                        output_kind)

    def child_request_ids(self, request_id: str) -> list[str]:
        """The engine requests of a user request still running."""
        return self.outputs.child_request_ids(request_id)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        stopped: list[str] | None = None
                        ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """User-facing outputs of the engine's; engine requests a stop string finished are
        appended to ``stopped`` (abort them in the engine)."""
        return self.outputs.process(outputs, stopped)
