"""A pipeline stage's share of a model (vLLM's ``make_layers`` and ``PPMissingLayer``).

A stage builds only its own decoder layers; the others are :class:`PPMissingLayer`s, which
hold no parameters (absent, not zero-filled), so module names keep their checkpoint indices
(``model.layers.7`` is layer 7 on whichever stage holds it) and a checkpoint's tensors for
another stage's layers are recognised and skipped at load (:func:`is_pp_missing`).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from llmkit.distributed.pipeline import PipelineParallelGroup


class PPMissingLayer(nn.Identity):
    """A module this stage does not hold."""


def make_layers(num_layers: int, build: Callable[[int], nn.Module],
                pp: PipelineParallelGroup) -> tuple[int, int, nn.ModuleList]:
    """``(start, end, layers)``: ``build(i)`` for this stage's layers ``[start, end)``, a
    :class:`PPMissingLayer` in every other place."""
    start, end = pp.layer_range(num_layers)
    layers = nn.ModuleList(build(i) if start <= i < end else PPMissingLayer()
                           for i in range(num_layers))
    return start, end, layers


def is_pp_missing(model: nn.Module, name: str) -> bool:
    """Whether the checkpoint tensor ``name`` belongs to a module this stage does not hold
    (any module on its dotted path is a :class:`PPMissingLayer`)."""
    module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None) if not part.isdigit() else (
            module[int(part)] if isinstance(module, nn.ModuleList) and int(part) < len(module)
            else None)
        if module is None:
            return False
        if isinstance(module, PPMissingLayer):
            return True
    return False
