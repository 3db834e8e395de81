"""Speculative decoding's proposer interface: draft tokens for the next step.

A proposer runs in the worker after each step's sampling (as in vLLM v1): it sees the
persistent batch (every request's tokens so far, its new ones included) and proposes up to K
draft tokens for some of the requests that decode next. The engine core hands them to the
scheduler (``Scheduler.update_draft_token_ids``), which schedules each drafted request 1 + K
tokens; the runner computes logits at all of them and the sampler verifies them
(``llmkit/sampling/rejection.py``), so the output distribution is the target's.

A proposer that runs a model (draft model, EAGLE) also keeps KV of its own in the target's
blocks: it names its cache layers (``kv_cache_layers``), the runner sizes every block for them
and hands it the tensors (``bind_kv_caches``). Such a proposer must see every step (also steps
where nothing samples) so that its KV covers every token the target computed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from llmkit.models.base import CausalLM, ModelContext
from llmkit.spec_decode.adaptive import DraftLengthPolicy


class ProposerBatch(Protocol):
    """What a proposer reads of the runner's persistent batch (the worker's ``InputBatch``
    satisfies it): proposers sit below the worker, which calls them, so they name the rows'
    arrays here instead of importing the worker's class. Arrays are indexed by batch row."""

    req_ids: list[str]
    max_model_len: int
    token_ids: np.ndarray  # int64 [max_reqs, max_model_len]: prompt + output tokens so far
    num_tokens: np.ndarray  # int64 [max_reqs]: tokens held in token_ids
    block_table: np.ndarray  # int32 [max_reqs, max_blocks]: the KV blocks, in order
    num_blocks: np.ndarray  # int64 [max_reqs]
    temperature: np.ndarray  # float32 [max_reqs]: sampling settings (drafts drawn like them)
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    generators: list[torch.Generator | None]  # per-request seeds' generators

    @property
    def num_reqs(self) -> int: ...


@dataclass(slots=True)
class StepContext:
    """What the target computed this step, per scheduled row (batch-row order); the batch
    already holds the step's new tokens."""

    rows: np.ndarray  # int64: the scheduled batch rows
    computed: np.ndarray  # int64: tokens the row had computed before the step
    num_scheduled: np.ndarray  # int64: tokens computed in the step (drafts included)
    query_starts: np.ndarray  # int64: the row's first token in the step's flat batch
    samples: np.ndarray  # bool: the row sampled (its step reached the end of its tokens)
    hidden_states: torch.Tensor | None = None  # the target's final hidden states [T, H]


@dataclass(slots=True)
class ProposerEnv:
    """What a proposer is built with: the target model (EAGLE shares its embeddings and LM
    head), the context models are built with (dtype, attention backend, platform ops, linear
    methods), and the engine's limits."""

    target: CausalLM
    ctx: ModelContext
    device: torch.device
    max_model_len: int
    block_size: int
    seed: int = 0


def num_valid_tokens(batch: ProposerBatch, ctx: StepContext) -> np.ndarray:
    """Per scheduled row: how many of its step's positions hold KV of known tokens (its
    prefill chunk; or its next token plus the accepted drafts)."""
    return np.minimum(ctx.num_scheduled, batch.num_tokens[ctx.rows] - 1 - ctx.computed)


class Proposer(ABC):
    """Proposes draft tokens; subclasses that draw drafts from a distribution keep it for the
    verification (``draft_probs``)."""

    #: K: the most draft tokens proposed per request and step.
    num_speculative_tokens: int = 0
    #: How many drafts a step may propose per row (adaptive K, disable_by_batch_size); None =
    #: always K.
    length_policy: DraftLengthPolicy | None = None

    @classmethod
    def from_config(cls, config: Any, env: ProposerEnv) -> "Proposer":
        """Build from a ``SpeculativeConfig`` (a ``_target_`` class overrides this)."""
        raise NotImplementedError(f"{cls.__name__} does not define from_config(config, env)")

    @abstractmethod
    def propose(self, batch: ProposerBatch, rows: np.ndarray,
                step: StepContext | None = None) -> dict[str, list[int]]:
        """Drafts for the requests at batch ``rows`` (those that sampled this step), keyed by
        request id; requests left out (or given ``[]``) are not drafted. ``step`` says what the
        target computed (model-based proposers need it; it is always given by the runner)."""

    def num_drafts(self, num_rows: int, num_running: int) -> int:
        """K for the next step, with ``num_rows`` rows that could be drafted out of
        ``num_running`` requests in the batch."""
        k = self.num_speculative_tokens
        if self.length_policy is None:
            return k
        return self.length_policy.num_drafts(k, num_rows, num_running)

    @property
    def observes_acceptance(self) -> bool:
        """Whether ``observe_acceptance`` has a use (adaptive K from measured step costs)."""
        return self.length_policy is not None and self.length_policy.step_costs is not None

    def observe_acceptance(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """A step's verified rows: the drafts each had and how many were accepted (adaptive K
        estimates the acceptance from them)."""
        if self.length_policy is not None:
            self.length_policy.observe(num_drafts, num_accepted)

    def draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The proposal distribution q of ``drafts`` (the first of the drafts proposed last for
        ``req_id``: the scheduler may cut them), float32 ``[len(drafts), V]`` on the runner's
        device (row j: the distribution draft j was drawn from), or ``None`` when the drafts
        are plain tokens (a one-hot q)."""
        return None

    # -- KV of the proposer's own (draft model, EAGLE) --------------------------------------
    def kv_cache_layers(self) -> list[tuple[int, int]]:
        """``(num_kv_heads, head_dim)`` of each KV layer the proposer keeps in the target's
        blocks; none by default."""
        return []

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's tensors for ``kv_cache_layers`` (same block count and layout as the
        target's)."""

