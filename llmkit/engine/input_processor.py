"""The front ends' one input processor: a prompt and its ``SamplingParams`` in, what the engine
may run out — or a ``ValueError`` naming what is wrong, before anything reaches the engine.

``LLM`` (in process) and ``AsyncLLM`` (the server's front end) both call it, so a prompt is
valid for one exactly when it is valid for the other. It checks against the served model's
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
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmkit.config.schema import EngineConfig
from llmkit.facts import ModelFacts
from llmkit.multimodal.base import MultiModalFeatureSpec
from llmkit.request import Request
from llmkit.sampling.bad_words import tokenize_bad_words
from llmkit.structured_output.validation import validate_structured_outputs
from llmkit.sampling.params import SamplingParams

__all__ = ["InputProcessor", "ProcessedPrompt", "PromptType", "build_input_processor",
           "multi_modal_images", "unpack_prompt_dict"]

# A prompt: text, token ids, or vLLM's dict form {"prompt" | "prompt_token_ids", "cache_salt"}.
PromptType = str | Sequence[int] | Mapping[str, Any]


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
