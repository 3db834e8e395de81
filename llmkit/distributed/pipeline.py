"""Pipeline parallel: which layers a stage holds, what passes between stages, and how.

A model's decoder layers are split into ``size`` consecutive stages (vLLM's ``get_pp_indices``:
as even as possible, the extra layers on the stages before the last, which also computes the
LM head). Stage ``s`` of ``size`` runs its layers on the hidden states and residual the
previous stage sent (:class:`IntermediateTensors`) and sends its own to the next; the first
stage embeds the tokens, the last applies the final norm and the LM head and samples.

Global ranks are laid out as vLLM's: ``rank = stage * tp_size + tp_rank``, so a stage's
tensor-parallel ranks are neighbours and each sends to the same TP rank of the next stage
(every TP rank holds the whole hidden state after the row-parallel all-reduce).

Passed to the model explicitly (``ModelContext.pp``); ``size == 1`` never touches
``torch.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)``: the decoder layers stage ``pp_rank`` of ``pp_size`` holds. Uneven
    splits give the remaining layers to the stages just before the last, as vLLM does (3
    layers over 2 stages: 2 + 1; 10 over 4: 2 + 3 + 3 + 2)."""
    if not 0 < pp_size <= num_layers:
        raise ValueError(f"{num_layers} layers cannot be split into {pp_size} pipeline stages")
    partitions = [num_layers // pp_size] * pp_size
    remaining = num_layers % pp_size
    for i in range(2, remaining + 2):  # the extra layers go before the last stage
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


@dataclass(slots=True)
class IntermediateTensors:
    """What one stage hands the next: the hidden states and the residual stream, both
    ``[num_tokens, hidden_size]`` (vLLM's name)."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden_states, self.residual


@dataclass(frozen=True, slots=True)
class PipelineParallelGroup:
    """A rank's stage, and the point-to-point transfers between stages."""

    rank: int = 0  # this rank's stage
    size: int = 1  # stages
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.size - 1

    def global_rank(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return get_pp_indices(num_layers, self.rank, self.size)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> IntermediateTensors:
        """The previous stage's tensors of a step of ``num_tokens`` tokens (both ranks know the
        step, so its shape needs no message of its own); blocks until they arrive."""
        src = self.global_rank(self.rank - 1)
        out = IntermediateTensors(
            torch.empty(num_tokens, hidden_size, dtype=dtype, device=device),
            torch.empty(num_tokens, hidden_size, dtype=dtype, device=device))
        for t in out.tensors():
            torch.distributed.recv(t, src=src)
        return out

    def isend(self, tensors: IntermediateTensors) -> "PendingSend":
        """Start sending to the next stage and return at once (this stage computes its next
        step meanwhile)."""
        dst = self.global_rank(self.rank + 1)
        ts = tuple(t.contiguous() for t in tensors.tensors())
        return PendingSend([torch.distributed.isend(t, dst=dst) for t in ts], ts)


@dataclass(slots=True)
class PendingSend:
    """A send in flight, with the tensors it reads: they must stay alive and unchanged until
    it completes."""

    works: list[Any]
    tensors: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        for w in self.works:
            w.wait()
