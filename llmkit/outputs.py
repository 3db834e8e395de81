"""What flows back: runner → scheduler (ModelRunnerOutput), core → front end (EngineCoreOutput),
and front end → user (RequestOutput / CompletionOutput, vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's result. ``sampled_token_ids[i]`` belongs to ``req_ids[i]``; it is empty for a
    request whose prefill chunk did not reach the end of its prompt (nothing to sample yet)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {r: i for i, r in enumerate(self.req_ids)}


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one step, and how it finished if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)
