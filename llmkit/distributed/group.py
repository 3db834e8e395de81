"""A rank's place in its tensor-parallel group, and the two collectives TP needs.

Passed to the model explicitly (``ModelContext.tp``): no process-wide "current group".
``size == 1`` never touches ``torch.distributed``, so single-process engines need no init.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from llmkit.distributed.pipeline import PipelineParallelGroup


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    #: a ``torch.distributed`` process group; ``None`` = the default (world) group
    process_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (returned for chaining)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def partition(self, units: int) -> tuple[int, int]:
        """``(parts, part)``: a layer of ``units`` indivisible units (heads, rows) is split into
        ``parts = min(size, units)`` parts and this rank holds part ``part`` (ranks beyond the
        units replicate: with 2 KV heads over 4 ranks, ranks 0-1 hold head 0, ranks 2-3 head 1)."""
        parts = min(self.size, units)
        return parts, self.rank * parts // self.size


def initialize_model_parallel(rank: int, tp_size: int, pp_size: int
                              ) -> tuple[TensorParallelGroup, "PipelineParallelGroup"]:
    """This rank's tensor-parallel group and pipeline stage (vLLM's name), after
    ``torch.distributed.init_process_group`` over all ``tp_size * pp_size`` ranks. Ranks are
    laid out stage-major (``rank = stage * tp_size + tp_rank``); with several stages each
    stage's TP ranks get a group of their own (every rank creates every group, in the same
    order, as torch.distributed requires), and the stages' sends use the world group."""
    from llmkit.distributed.pipeline import PipelineParallelGroup

    stage, tp_rank = divmod(rank, tp_size)
    process_group = None  # one stage: the world is the TP group
    if pp_size > 1 and tp_size > 1:
        for s in range(pp_size):
            g = torch.distributed.new_group(ranks=list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                process_group = g
    return (TensorParallelGroup(tp_rank, tp_size, process_group),
            PipelineParallelGroup(stage, pp_size, tp_rank, tp_size))
