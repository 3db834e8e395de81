"""``Frontend``: the one place a user's request becomes engine requests and the engine's tokens
become text again. ``LLM`` (in process), ``AsyncLLM`` (the server's engine) and the OpenAI
layer all go through it, so a prompt, a chat or a sampling default means the same in each:

- the model's side (``FrontendModel.load``): its tokenizer and recommended sampling defaults;
- prompts: tokenized and checked against the engine's ``ModelFacts`` (``InputProcessor``,
  below);
- chats: the model's chat template (``render_chat``, ``apply_chat_template``) and the images of
  content parts, decoded under the config's limits and replaced by the model's placeholder
  (``split_images``, ``chat_prompt``);
- defaults: ``sampling_params=None`` is the model's defaults (``sampling_params``);
- ``n > 1``: fanned out into engine requests ``"{i}_{id}"`` with seeds ``seed + i``, and their
  outputs merged back, detokenized and stop strings matched (``OutputProcessor``).

Which engine runs the requests, and how they reach it, is the callers' business
(``llmkit.engine.client``).

``InputProcessor``: a prompt and its ``SamplingParams`` in, what the engine may run out — or a
``ValueError`` naming what is wrong, before anything reaches the engine, so a prompt is valid
for ``LLM`` exactly when it is valid for ``AsyncLLM``. It checks against the served model's
``ModelFacts`` (the engine's own: ``EngineCore.model_facts``, or what the engine process
reported when it was ready):

- the prompt: text (tokenized here), token ids, or vLLM's dict form ``{"prompt" |
  "prompt_token_ids", "cache_salt", "multi_modal_data"}``; not empty, at most
  ``max_model_len`` tokens (image tokens included), every id in ``[0, vocab_size)``;
- ``multi_modal_data`` (``{"image": PIL.Image | [PIL.Image, ...]}``, multimodal models only):
  one image per placeholder, at most ``multimodal.limit_mm_per_prompt``; the multimodal
  processor expands each placeholder to the image's tokens here, before the engine sees the
  prompt;
- ``logit_bias``, ``allowed_token_ids``, ``stop_token_ids``: ids in ``[0, vocab_size)`` (an id
  beyond the vocabulary would fail inside the engine's step, for the whole batch);
- ``logprobs``, ``prompt_logprobs``: at most ``vocab_size``;

and completes the parameters: ``bad_words`` tokenized (``bad_words_token_ids``), the model's
extra EOS ids (after the first; e.g. a chat model's end-of-turn) added as stop tokens (vLLM's
rule: the first EOS id is the EOS, which ``ignore_eos`` turns off).
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmkit.config.schema import EngineConfig, ModelConfig
from llmkit.engine.output_processor import OutputProcessor, RequestOutputKind
from llmkit.facts import ModelFacts
from llmkit.models.generation_config import default_sampling_fields, describe_defaults
from llmkit.models.loader import ModelSource, resolve_model_source
from llmkit.models.pooling_config import PoolingSpec, resolve_pooling
from llmkit.multimodal.base import MultiModalFeatureSpec
from llmkit.outputs import EmbeddingRequestOutput, EngineCoreOutput, RequestOutput
from llmkit.request import Request
from llmkit.sampling.bad_words import tokenize_bad_words
from llmkit.sampling.params import SamplingParams
from llmkit.startup import startup_step
from llmkit.structured_output.validation import validate_structured_outputs

__all__ = ["Frontend", "FrontendModel", "InputProcessor", "Message", "ProcessedPrompt",
           "PromptType", "build_input_processor", "multi_modal_images", "unpack_prompt_dict"]

Message = Mapping[str, Any]
# A prompt: text, token ids, or vLLM's dict form {"prompt" | "prompt_token_ids", "cache_salt"}.
PromptType = str | Sequence[int] | Mapping[str, Any]

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


# --------------------------------------------------------------------------- prompts in

@dataclasses.dataclass(slots=True)
class ProcessedPrompt:
    """A validated prompt and its completed parameters."""

    text: str | None  # the prompt's text, when it was given as text
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    mm_features: list[MultiModalFeatureSpec] = dataclasses.field(default_factory=list)

    def to_request(self, request_id: str, params: SamplingParams | None = None, *,
                   eos_token_id: int | None, arrival_time: float,
                   priority: int = 0, lora_id: int | None = None) -> Request:
        """The engine ``Request`` (``params``: a fanned-out child's, default this one's;
        ``lora_id``: the LoRA adapter's ``lora_int_id``, None = the base model)."""
        return Request(request_id, self.token_ids, params or self.params,
                       eos_token_id=eos_token_id, arrival_time=arrival_time,
                       priority=priority, cache_salt=self.cache_salt, lora_id=lora_id,
                       mm_features=self.mm_features)


class InputProcessor:
    """A prompt and its ``SamplingParams`` checked and completed for the engine (the module
    docstring lists the checks); ``Frontend.process`` runs it for every entry point."""

    def __init__(self, tokenizer: Any, facts: ModelFacts,
                 config: EngineConfig | None = None, mm_processor: Any = None) -> None:
        # llmkit.multimodal.MultiModalProcessor of a multimodal model; None: text only.
        self.mm_processor = mm_processor
        self.tokenizer = tokenizer
        self.facts = facts
        self.extra_stop_ids = list(facts.eos_token_ids[1:])
        # The engine's config: its structured-output backend checks grammars before the engine
        # sees them (a bad spec is a ValueError, an HTTP 400, never a failed step).
        self.config = config

    def process(self, prompt: PromptType, params: SamplingParams, *,
                cache_salt: str | None = None) -> ProcessedPrompt:
        """Validate ``prompt`` and ``params`` (see the module docstring). A dict prompt's
        ``cache_salt`` wins over the argument."""
        images: list[Any] = []
        if isinstance(prompt, Mapping):
            images = multi_modal_images(prompt.get("multi_modal_data"))
            prompt, salt = unpack_prompt_dict(prompt)
            cache_salt = salt if salt is not None else cache_salt
        text, ids = self.tokenize(prompt)
        features: list[MultiModalFeatureSpec] = []
        if self.mm_processor is not None:
            ids, features = self.mm_processor.process(ids, images)
            self.check_images(features)
        elif images:
            raise ValueError("this model takes no images (multi_modal_data); serve a "
                             "multimodal model such as LLaVA")
        self.check_prompt(ids)
        return ProcessedPrompt(text, ids, self.process_params(params), cache_salt, features)

    def check_images(self, features: Sequence[MultiModalFeatureSpec]) -> None:
        if self.config is None:
            return
        s = self.config.scheduler
        limit = min(s.encoder_cache_size, s.max_num_encoder_input_tokens)
        for f in features:
            if f.length > limit:
                raise ValueError(f"an image of {f.length} tokens exceeds "
                                 f"scheduler.encoder_cache_size ({s.encoder_cache_size}) or "
                                 "scheduler.max_num_encoder_input_tokens "
                                 f"({s.max_num_encoder_input_tokens})")

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)``; ids given are checked against the vocabulary."""
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and all(_is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
            self.check_token_ids("prompt", ids)
            return None, ids
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got "
                        f"{type(prompt).__name__}")

    def check_prompt(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        limit = self.facts.max_model_len
        if len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than this model's maximum "
                             f"context length (model.max_model_len={limit}); shorten it or "
                             "raise model.max_model_len")

    def check_token_ids(self, what: str, ids: Iterable[int]) -> None:
        vocab = self.facts.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ValueError(f"{what}: token id {t} is out of range (the vocabulary has "
                                 f"{vocab} tokens)")

    def process_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the vocabulary and completed (bad words, extra EOS)."""
        vocab = self.facts.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            value = getattr(params, name)
            if value:
                self.check_token_ids(f"SamplingParams.{name}", [int(t) for t in value])
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"SamplingParams.{name}: at most the vocabulary size ({vocab}), "
                                 f"got {value}")
        if params.structured_outputs is not None and self.config is not None:
            validate_structured_outputs(self.config, params.structured_outputs)
        changes: dict[str, Any] = {}
        if self.extra_stop_ids:
            changes["stop_token_ids"] = list(params.stop_token_ids or []) + self.extra_stop_ids
        if params.bad_words and params.bad_words_token_ids is None:
            changes["bad_words_token_ids"] = tokenize_bad_words(params.bad_words, self.tokenizer)
        return dataclasses.replace(params, **changes) if changes else params


def build_input_processor(source: Any, tokenizer: Any, facts: ModelFacts,
                          config: EngineConfig) -> InputProcessor:
    """The input processor of the model ``source`` (a ``ModelSource``), with its multimodal
    processor when the model takes images."""
    from llmkit.multimodal.processor import multimodal_processor_for

    mm = multimodal_processor_for(source.path, source.hf_config, tokenizer,
                                  config.multimodal.limit("image"))
    return InputProcessor(tokenizer, facts, config, mm)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def multi_modal_images(data: Any) -> list[Any]:
    """vLLM's ``multi_modal_data``: ``{"image": image | [images]}`` -> the images."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise ValueError(f"prompt dict: multi_modal_data must be a dict, got "
                         f"{type(data).__name__}")
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modalities {sorted(unknown)}; "
                         "supported: image")
    images = data.get("image", [])
    return list(images) if isinstance(images, (list, tuple)) else [images]


def unpack_prompt_dict(prompt: Mapping[str, Any]) -> tuple[str | list[int], str | None]:
    """vLLM's TextPrompt / TokensPrompt: the prompt and its ``cache_salt`` (requests with
    different salts share no KV blocks, e.g. to isolate tenants). ``multi_modal_data`` is
    read by ``multi_modal_images``."""
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
    if unknown:
        raise ValueError(f"prompt dict: unknown keys {sorted(unknown)}; allowed: prompt, "
                         "prompt_token_ids, cache_salt, multi_modal_data")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt dict: give exactly one of 'prompt' and 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"prompt dict: cache_salt must be a string, got {type(salt).__name__}")
    body = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return body, salt
