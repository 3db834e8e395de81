"""A request as the engine core sees it: token ids, progress, status and timestamps."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from llmkit.sampling.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Structured output: its grammar compiles in the background; it joins WAITING when ready.
    WAITING_FOR_FSM = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7
    # The engine could not serve it (its grammar failed to compile); the message is the
    # output's ``stop_reason``.
    FINISHED_ERROR = 8
    # Disaggregated serving: its blocks are allocated and its KV is being loaded from another
    # engine (``llmkit/kv_transfer``); it is not scheduled until the blocks are local.
    WAITING_FOR_REMOTE_KVS = 9
    # scheduler=slo with scheduler.slo_admission=reject: predicted to miss its SLO while it
    # waited, it ends unserved; the reason is the output's ``stop_reason`` (HTTP 429).
    FINISHED_REJECTED = 10

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # A refused request (prompt too long) reports "length" as vLLM does.
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    # refused by the SLO scheduler's admission: "abort", as vLLM names a request it ended
    RequestStatus.FINISHED_REJECTED: "abort",
}

_S = RequestStatus
_FINISHED = {_S.FINISHED_STOPPED, _S.FINISHED_LENGTH_CAPPED, _S.FINISHED_ABORTED, _S.FINISHED_IGNORED,
             _S.FINISHED_ERROR, _S.FINISHED_REJECTED}
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.WAITING_FOR_FSM, _S.WAITING_FOR_REMOTE_KVS, _S.RUNNING,
                           _S.FINISHED_ABORTED, _S.FINISHED_IGNORED, _S.FINISHED_REJECTED}),
    _S.WAITING_FOR_REMOTE_KVS: frozenset({_S.WAITING, _S.FINISHED_ABORTED}),
    _S.WAITING_FOR_FSM: frozenset({_S.WAITING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.RUNNING: frozenset({_S.PREEMPTED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH_CAPPED,
                           _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    **{s: frozenset() for s in _FINISHED},
}


class IllegalTransition(RuntimeError):
    """A status change the request state machine does not allow."""


@dataclass(slots=True)
class RequestTimes:
    """Timestamps from the scheduler's clock (seconds); ``None`` until the event happens."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Request:
    """One generation request inside the engine core.

    ``all_token_ids`` is prompt + output; ``num_computed_tokens`` counts those whose KV is in
    the cache (or will be, once the scheduled step runs). ``block_hashes`` holds the hashes of
    the request's full blocks, filled by the KV cache manager as blocks fill.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority",
        "cache_salt", "lora_id", "lora_name", "mm_hashes", "mm_features", "all_token_ids",
        "output_token_ids",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "status", "stop_reason",
        "times", "block_hashes", "max_tokens", "arrival_index", "spec_token_ids",
        "structured_output_request", "kv_transfer_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        mm_hashes: tuple[str, ...] = (),
        lora_name: str | None = None,
        mm_features: list[Any] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id  # the LoRA adapter's lora_int_id (None = the base model)
        self.lora_name = lora_name
        # The prompt's images (llmkit.multimodal.MultiModalFeatureSpec), in prompt order:
        # their placeholder ranges, content hashes and encoder inputs.
        self.mm_features: list[Any] = list(mm_features or ())
        self.mm_hashes = tuple(mm_hashes) or tuple(f.identifier for f in self.mm_features)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not admitted yet
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.times = RequestTimes(arrival=arrival_time)
        self.block_hashes: list[bytes] = []
        self.max_tokens = self.sampling_params.max_tokens
        self.arrival_index = 0  # set by the scheduler: ties in priority break by arrival
        # Draft tokens proposed for the next step (speculative decoding): verified, never
        # part of all_token_ids until accepted.
        self.spec_token_ids: list[int] = []
        # Its grammar and matcher (llmkit.structured_output), set by the scheduler's
        # structured-output manager when ``sampling_params.structured_outputs`` is given.
        self.structured_output_request: Any = None
        # Disaggregated serving: what the caller passed (``extra_args["kv_transfer_params"]``);
        # the KV connector reads it, and replaces it with what it hands back at the finish.
        extra = self.sampling_params.extra_args
        self.kv_transfer_params: dict | None = extra.get("kv_transfer_params") if extra else None

    # -- state machine -------------------------------------------------------------------
    def set_status(self, new: RequestStatus) -> None:
        if new not in ALLOWED_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"request {self.request_id!r}: {self.status.name} -> {new.name} is not allowed")
        self.status = new

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    # -- tokens --------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def block_hash_extra_keys(self) -> tuple[Any, ...] | None:
        """What besides token ids makes two blocks' KV differ: adapter, images, salt."""
        if self.lora_id is None and not self.mm_hashes and self.cache_salt is None:
            return None
        return (self.lora_id, self.mm_hashes, self.cache_salt)

    def block_extra_keys(self, start: int, end: int) -> tuple[Any, ...] | None:
        """The extra keys of the block of tokens ``[start, end)`` (vLLM's rule for images):
        the hashes of the images whose placeholders it overlaps. Blocks before an image share
        across requests with other images; the parent chain carries an image's hash into every
        block after it."""
        mm = tuple(f.identifier for f in self.mm_features
                   if f.offset < end and start < f.offset + f.length)
        if self.lora_id is None and not mm and self.cache_salt is None:
            return None
        return (self.lora_id, mm, self.cache_salt)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
