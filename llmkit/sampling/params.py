"""SamplingParams: vLLM's names, defaults and meanings, validated at construction."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

#: "Is this row greedy": a temperature below this takes the argmax, at or above it the row
#: draws. The one definition every sampler, the runner's batch and the drafters use.
GREEDY_EPS = 1e-5


def is_greedy(temperature):
    """Whether ``temperature`` samples greedily: a float, or elementwise an array or tensor."""
    return temperature < GREEDY_EPS


def is_random(temperature):
    """``not is_greedy``, elementwise without the extra negation (on a step's rows)."""
    return temperature >= GREEDY_EPS

# OpenAI and vLLM clamp a logit bias to this range.
_MAX_ABS_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's names): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value of it;
    - ``regex``: the output fully matches this regular expression;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: an EBNF (GBNF) grammar as xgrammar reads it, with a ``root`` rule;
    - ``json_object=True``: the output is some JSON object.

    The engine compiles the grammar off the step path; an invalid or unsupported spec fails
    that request alone with a ``ValueError`` naming what is wrong.

    ``reasoning_end_token_ids``: the constraint starts after the output has written these
    tokens (a reasoning model's end-of-thinking marker, e.g. ``</think>``): the thinking before
    it is free, the answer after it follows the grammar (vLLM's reasoning-aware structured
    output). None: from the first output token.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams: give exactly one of json, regex, choice, "
                             f"grammar, json_object=True; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"StructuredOutputsParams.json: a JSON schema (dict or JSON "
                             f"text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{name}: a non-empty string, got "
                                 f"{v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice: a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError("StructuredOutputsParams.reasoning_end_token_ids: a non-empty "
                                 f"list of token ids, got {ids!r}")
            self.reasoning_end_token_ids = list(ids)


class RequestOutputKind(enum.Enum):
    """What each streamed ``RequestOutput`` carries (vLLM's names)."""

    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding parameters.

    Names, defaults and meanings follow vLLM (and the OpenAI API where it has the field):

    - ``n``: independent samples of the prompt (the prompt is prefilled once and shared).
    - ``temperature`` (0 = greedy), ``top_p`` (1 = off), ``top_k`` (0 or -1 = off),
      ``min_p`` (0 = off; keeps tokens with ``p >= min_p * p_max``).
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2]: OpenAI's formula over the
      generated tokens; ``repetition_penalty`` > 0 (1 = off): HF/CTRL's over prompt + output.
    - ``logit_bias``: ``{token_id: bias}`` added to the logits, clamped to [-100, 100];
      ``allowed_token_ids``: only these may be sampled; ``bad_words``: words never generated.
    - ``stop`` (strings, matched on the detokenized text), ``stop_token_ids``,
      ``include_stop_str_in_output``, ``ignore_eos``, ``max_tokens`` (None = up to
      ``max_model_len``), ``min_tokens`` (EOS and stop tokens are masked until reached).
    - ``logprobs`` / ``prompt_logprobs``: top-k logprobs (plus the chosen token's) per token,
      from the model's raw distribution (before penalties and temperature).
    - ``seed``: this request's own RNG; its output does not depend on the rest of the batch.
    - ``skip_special_tokens``, ``spaces_between_special_tokens``: detokenization.
    - ``structured_outputs``: a :class:`StructuredOutputsParams` (JSON schema, regex, choice,
      grammar); the sampler may only pick tokens that keep the output in its language.

    ``bad_words_token_ids`` is filled by the front end from ``bad_words`` and the tokenizer.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Free-form arguments for components (vLLM's name); ``extra_args["kv_transfer_params"]``
    # carries disaggregated serving's hand-over (``llmkit/kv_transfer``).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) \
                else list(self.bad_words)
        self._validate()
        if self.logit_bias:
            # JSON bodies carry string keys; OpenAI and vLLM clamp the values.
            self.logit_bias = {int(t): min(_MAX_ABS_LOGIT_BIAS, max(-_MAX_ABS_LOGIT_BIAS,
                                                                     float(b)))
                               for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if isinstance(self.structured_outputs, dict):  # as it crosses a process boundary
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def _validate(self) -> None:
        def bad(name: str, why: str, value: Any = None) -> ValueError:
            shown = getattr(self, name) if value is None else value
            return ValueError(f"SamplingParams.{name}: {why}, got {shown!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (off) or a positive integer")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "must be None or an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip()
                                              for w in self.bad_words):
            raise bad("bad_words", "must be non-blank strings")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict {token_id: bias}")
            for t, b in self.logit_bias.items():
                if not _token_key(t):
                    raise bad("logit_bias", "keys must be non-negative token ids", t)
                if not _is_real(b) or math.isnan(b):
                    raise bad("logit_bias", "values must be numbers", b)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must be None or a non-empty list")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, (StructuredOutputsParams, dict)):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token_key(t: Any) -> bool:
    if _is_int(t):
        return t >= 0
    return isinstance(t, str) and t.isdigit()
