"""The portable linear method: ``F.linear`` on the dense weight (the reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.linear.base import LinearMethod


class TorchLinearMethod(LinearMethod):
    name = "torch"

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
