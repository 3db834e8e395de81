"""The scheduler interface and the metadata it hands the runner each step.

The scheduler decides, per step, how many tokens each request computes; it never touches
tensors. Requests the runner has not seen (new, or resumed after preemption, whose KV must be
recomputed) travel in full; requests it already holds travel as diffs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import numpy as np

from llmkit.kv_transfer.base import KVConnectorStats
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.encoder_cache import EncoderCacheStats


@dataclass(slots=True)
class NewRequestData:
    """A request the runner must (re)build: its tokens so far, blocks and progress."""

    req_id: str
    token_ids: list[int]  # prompt + output so far (a resumed request recomputes all of it)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # Its block table row (``list[int]``); one row per KV-cache group (a sequence of lists)
    # for a model with several groups (``KVCacheManagerBase.num_groups``). Typed loosely: the
    # step codec (msgspec) takes no union of two list types.
    block_ids: list
    num_computed_tokens: int
    # The runner masks EOS (with stop_token_ids) until ``min_tokens`` outputs exist.
    eos_token_id: int | None = None
    # The LoRA adapter the request computes with (its ``lora_int_id``; None = the base model).
    lora_id: int | None = None
    # The prompt's images (llmkit.multimodal.MultiModalFeatureSpec): placeholder ranges, hashes
    # and encoder inputs.
    mm_features: list = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # With several KV-cache groups each entry (and each offset) is a sequence, one per group.
    new_block_ids: list[list] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Where ``new_block_ids`` start in the request's block list: the blocks the runner holds
    # past it were given back (slots of rejected draft tokens).
    block_ids_offset: list = field(default_factory=list)
    # Pipeline parallel only (else empty): each request's tokens this step computes, from
    # ``num_computed_tokens`` on. Ranks before the last stage never sample, so this is how they
    # learn the tokens the last stage sampled (vLLM's ``new_token_ids``).
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step (finished or aborted) or were preempted now:
    # the runner drops their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding: the draft tokens each request verifies this step (its scheduled
    # tokens are its next token plus these); its logits are computed at all 1 + K positions.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: the step's requests whose logits are constrained, in bitmask order,
    # and their packed bitmask (xgrammar's layout: int32 [rows, ceil(V / 32)], bit i of word j
    # allows token 32 * j + i), one row per logits position of each listed request in order
    # (1 + K rows for a request verifying K draft tokens). None when no request is constrained.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Multimodal: the images each request encodes this step (indices into its mm_features;
    # the runner caches their outputs by content hash), and the hashes the encoder cache
    # evicted (the runner drops their outputs).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # KV connector (llmkit/kv_transfer): this step's loads and saves for its worker side.
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding counters since start-up (definitions in API.md).

    - ``num_drafts``: verify steps of requests that had draft tokens;
    - ``num_draft_tokens``: draft tokens proposed (and verified);
    - ``num_accepted_tokens``: draft tokens accepted;
    - ``accepted_per_position[j]``: drafts accepted at position j (0-based) of their run;
    - ``acceptance_rate`` = accepted / draft tokens;
    - ``mean_acceptance_length`` = 1 + accepted / drafts: tokens a drafted request gains per
      verify step (the +1 is the token the target itself samples).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_position
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))

    def since(self, before: "SpecDecodeStats") -> "SpecDecodeStats":
        """What was counted after ``before`` (an earlier snapshot of these counters)."""
        old = before.accepted_per_position
        per_pos = [n - (old[j] if j < len(old) else 0)
                   for j, n in enumerate(self.accepted_per_position)]
        return SpecDecodeStats(self.num_drafts - before.num_drafts,
                               self.num_draft_tokens - before.num_draft_tokens,
                               self.num_accepted_tokens - before.num_accepted_tokens, per_pos)


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot after a step (cumulative counters are since start-up)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_num_scheduled_tokens: int = 0
    step_num_preemptions: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # Multi-LoRA: running / waiting requests per adapter name (vLLM's lora_requests_info).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # the same counters for the latest step alone
    step_spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    encoder_cache: EncoderCacheStats = field(default_factory=EncoderCacheStats)
    # KV connector counters (llmkit/kv_transfer), when one is configured.
    kv_connector: KVConnectorStats | None = None
    # Per KV-cache group ("<index>:<spec>", e.g. "0:full"): the fraction of the pool its
    # requests hold (one group: kv_usage; llmkit.scheduler.token_budget.KVGroupUsage).
    kv_usage_by_group: dict[str, float] = field(default_factory=dict)
    # scheduler=slo: requests its admission rejected / deferred since start-up (each once)
    slo_rejected_total: int = 0
    slo_deferred_total: int = 0


class Scheduler(ABC):
    """What the engine core drives: add, schedule, update, abort; the methods below are the
    ones its step loop, its observers and its stats call, and nothing else.

    The engine core builds a scheduler as ``cls(config, kv_cache_manager, max_model_len=...,
    eos_token_id=..., clock=..., structured_output_manager=...)``, plus ``kv_connector=...``
    when a KV connector is configured (``llmkit/kv_transfer``: the scheduler then follows its
    protocol: external matches, WAITING_FOR_REMOTE_KVS, delayed frees), ``max_loras=...`` with
    LoRA, ``drop_last_cached_block=True`` with EAGLE and ``pipeline_parallel_size=...`` under
    pipeline parallelism; a scheduler that admits requests with
    ``sampling_params.structured_outputs`` holds them until the manager's grammar is ready and
    fills ``SchedulerOutput.grammar_bitmask``. ``TokenBudgetScheduler`` does all of that
    through its features (``hooks.py``).
    """

    #: Whether the constructor takes ``max_loras`` and ``max_lora_skips`` (a step's adapters
    #: kept within the LoRA slots); the engine refuses ``lora.enabled`` otherwise.
    supports_lora: ClassVar[bool] = False
    #: Whether the constructor takes ``slo`` (the ``slo.*`` objectives) and ``step_time`` (the
    #: cost model's step-time prediction): an SLO-aware scheduler.
    serves_slo: ClassVar[bool] = False

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput, *,
                           step_s: float | None = None) -> list[EngineCoreOutput]:
        """Apply a step's results. ``step_s``: the step's measured time on the engine's clock
        (seconds between this step's output and the previous one's when the engine stepped
        without pause, else from the step's start; None when not measured: batches in flight
        overlap), which a scheduler that predicts step times learns from."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    @abstractmethod
    def unfinished_requests(self) -> Iterable[Request]:
        """Every request the scheduler holds (waiting, compiling, running, preempted)."""

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, None if there is none (observers read a
        running request's prompt length before the step's update)."""
        return next((r for r in self.unfinished_requests() if r.request_id == request_id),
                    None)

    @abstractmethod
    def stats(self) -> SchedulerStats: ...

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Draft tokens proposed for the next step (speculative decoding). A scheduler that
        cannot verify drafts refuses them."""
        if any(draft_token_ids.values()):
            raise NotImplementedError(f"{type(self).__name__} does not schedule draft tokens")
