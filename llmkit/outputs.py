"""What flows back: runner → scheduler (ModelRunnerOutput), core → front end (EngineCoreOutput),
and front end → user (RequestOutput / CompletionOutput, vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs of consecutive positions, as plain lists (they cross process boundaries).

    Per position ``i``: ``token_ids[i][0]`` is the chosen token (sampled, or the prompt's next
    token), ``token_ids[i][1:]`` the top-k of the distribution in descending order;
    ``logprobs[i]`` their logprobs; ``ranks[i]`` the chosen token's rank (1 = most likely; the
    number of tokens at least as likely). The top-k ranks are 1..k by construction.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end],
                             self.ranks[start:end])

    @staticmethod
    def concat(parts: list["LogprobsLists"]) -> "LogprobsLists":
        out = LogprobsLists([], [], [])
        for p in parts:
            out.token_ids.extend(p.token_ids)
            out.logprobs.extend(p.logprobs)
            out.ranks.extend(p.ranks)
        return out


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's result. ``sampled_token_ids[i]`` belongs to ``req_ids[i]``: the tokens the
    request gained (one, or with draft tokens its accepted drafts plus one); it is empty for a
    request whose prefill chunk did not reach the end of its prompt (nothing to sample yet).

    ``logprobs[req_id]`` has one position per sampled token of requests that asked for
    ``logprobs``; ``prompt_logprobs[req_id]`` covers prompt positions 1..P-1 and is sent once,
    in the step whose prefill reaches the end of the prompt (chunks accumulate in the runner).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = {}
    prompt_logprobs: dict[str, LogprobsLists] = {}
    # Speculative decoding: draft tokens proposed for the next step, per request.
    draft_token_ids: dict[str, list[int]] = {}

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
    # One position per token of ``new_token_ids`` (requests with ``logprobs``), and the prompt's
    # logprobs once (requests with ``prompt_logprobs``).
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None

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
