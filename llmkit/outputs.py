"""What flows back: runner → scheduler (ModelRunnerOutput), core → front end (EngineCoreOutput),
and front end → user (RequestOutput / CompletionOutput, vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

# The start of a ``stop_reason`` that says the SLO scheduler refused the request
# (``scheduler.slo_admission=reject``): its finish_reason is "abort" and the rest of the text
# says why (the predicted figure and the objective). The server answers such a request 429.
SLO_REJECTED = "slo_rejected"


def is_slo_rejection(finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """Whether an output with these reasons is the SLO scheduler's refusal."""
    return finish_reason == "abort" and isinstance(stop_reason, str) \
        and stop_reason.startswith(SLO_REJECTED)


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


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the worker side of a KV connector reports after a step (``llmkit/kv_transfer``).

    - ``finished_sending``: requests whose held blocks the receiver has (or gave up on): the
      scheduler may free them now;
    - ``finished_recving``: requests whose KV finished loading (asynchronously), with or
      without success; those in ``failed_recving`` too failed and are recomputed;
    - the counters are this step's transfers, for metrics.
    """

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    failed_recving: list[str] = []
    num_loaded_blocks: int = 0
    num_saved_blocks: int = 0
    loaded_bytes: int = 0
    saved_bytes: int = 0
    load_s: float = 0.0
    # offload tiers: the bytes a block stored this step takes in its tier (compressed)
    stored_nbytes: dict[bytes, int] = {}

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.num_loaded_blocks
                    or self.num_saved_blocks)


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
    # KV connector (llmkit/kv_transfer): finished transfers and this step's counters.
    kv_connector_output: KVConnectorOutput | None = None
    # Pooling (model.runner=pooling): the embedding of each request whose prompt this step
    # completed; such a request samples nothing and finishes (llmkit/worker/pooling.py).
    pooler_output: dict[str, list[float]] = {}

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
    # Disaggregated serving: what a producer hands back so that a consumer can load the
    # request's KV (``llmkit/kv_transfer``); set on the finishing output only.
    kv_transfer_params: dict | None = None
    # Pooling: the prompt's embedding, on the (finishing) output of a pooling request.
    pooling_output: list[float] | None = None

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
    # Disaggregated serving: a producer's transfer handle (see ``EngineCoreOutput``).
    kv_transfer_params: dict | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's name: the prompt's pooled hidden state (normalized where the model's pooling
    says), ``model.runner=pooling``."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)
