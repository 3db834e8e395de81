"""Speculative decoding's proposer interface: draft tokens for the next step.

A proposer runs in the worker after each step's sampling (as in vLLM v1): it sees the
persistent batch (every request's tokens so far, its new ones included) and proposes up to K
draft tokens for some of the requests that decode next. The engine core hands them to the
scheduler (``Scheduler.update_draft_token_ids``), which schedules each drafted request 1 + K
tokens; the runner computes logits at all of them and the sampler verifies the drafts
(``llmkit/sampling/rejection.py``), so the output distribution is the target's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from llmkit.worker.input_batch import InputBatch


class Proposer(ABC):
    """Proposes draft tokens (a one-hot proposal: tokens, no distribution)."""

    #: K: the most draft tokens proposed per request and step.
    num_speculative_tokens: int = 0

    @abstractmethod
    def propose(self, batch: InputBatch, rows: np.ndarray) -> dict[str, list[int]]:
        """Drafts for the requests at batch ``rows`` (those that sampled this step), keyed by
        request id; requests left out (or given ``[]``) are not drafted."""
