"""Prompt logprobs: the logprob of every prompt token given the tokens before it.

Position ``j`` of the prompt (``1 <= j < P``) is scored from the hidden state at ``j - 1``.
A chunk computing positions ``[c, c + n)`` scores prompt tokens ``c + 1 .. min(c + n, P - 1)``;
the runner accumulates chunks and hands the whole list over once, in the step whose chunk
reaches the end of the prompt (the step that samples the first token), as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmkit.outputs import LogprobsLists
from llmkit.sampling.logprobs import compute_logprobs

if TYPE_CHECKING:
    from llmkit.lora.manager import LoRAManager
    from llmkit.worker.input_batch import InputBatch, StepInputs

# Rows of logits computed at a time: bounds memory to SLICE x vocab floats for long prompts.
_SLICE = 512


@dataclass(slots=True)
class PromptLogprobsState:
    num_logprobs: int
    num_prompt_tokens: int
    next_position: int = 0  # first position not yet scored (scores go to position + 1)
    parts: list[LogprobsLists] = field(default_factory=list)


def score_chunk(state: PromptLogprobsState, hidden: torch.Tensor, compute_logits,
                token_ids: np.ndarray, start: int, computed: int, num_scheduled: int) -> None:
    """Score this chunk's prompt positions. ``hidden`` holds the step's hidden states, the
    chunk's at ``[start, start + num_scheduled)``; ``token_ids`` is the request's token row."""
    if computed != state.next_position:
        raise RuntimeError(
            f"prompt logprobs: chunk starts at position {computed} but position "
            f"{state.next_position} was expected; a request with prompt_logprobs must not take "
            "prefix-cache hits (cached positions have no logits)")
    end = min(computed + num_scheduled, state.num_prompt_tokens - 1)
    for lo in range(computed, end, _SLICE):
        hi = min(lo + _SLICE, end)
        h = hidden[start + lo - computed:start + hi - computed]
        logits = compute_logits(h)
        targets = torch.from_numpy(token_ids[lo + 1:hi + 1].copy()).to(logits.device)
        state.parts.append(compute_logprobs(logits, targets, state.num_logprobs).to_lists())
    state.next_position = computed + num_scheduled


def finished(state: PromptLogprobsState) -> bool:
    return state.next_position >= state.num_prompt_tokens


def collect(state: PromptLogprobsState) -> LogprobsLists:
    return LogprobsLists.concat(state.parts)


def score_step(states: dict[str, PromptLogprobsState], inputs: StepInputs, hidden: torch.Tensor,
               batch: InputBatch, compute_logits,
               lora_manager: LoRAManager | None) -> dict[str, LogprobsLists]:
    """Prompt logprobs of this step's chunks; the full list of each prompt it completes (its
    state then leaves ``states``)."""
    done: dict[str, LogprobsLists] = {}
    for i, rid in enumerate(inputs.req_ids):
        state = states.get(rid)
        if state is None:
            continue
        row = int(inputs.rows[i])
        logits_fn = compute_logits
        if lora_manager is not None:  # the rows are this request's: its adapter
            logits_fn = lora_manager.logits_fn(int(batch.lora_id[row]), compute_logits)
        score_chunk(state, hidden, logits_fn, batch.token_ids[row], int(inputs.query_starts[i]),
                    int(inputs.computed[i]), int(inputs.num_scheduled[i]))
        if finished(state):
            done[rid] = collect(state)
            del states[rid]
    return done
