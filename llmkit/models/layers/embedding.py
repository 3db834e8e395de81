"""Token embedding (also the output projection when the model ties them).

A GGUF embedding in a kept block type (``model.quantization=gguf``; SmolLM2's Q8_0) stays
packed: a lookup dequantizes only the rows it needs, and a tied LM head multiplies with the
same packed rows (``llmkit/linear/quantized.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.linear.base import copy_weight
from llmkit.linear.quantized import GGUFRows


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.packed = None  # llmkit.kernels.quant.weights.PackedWeight when kept quantized

    def load_weight(self, loaded: torch.Tensor | GGUFRows, name: str = "") -> None:
        if not isinstance(loaded, GGUFRows):
            copy_weight(self.weight, loaded, name)
            return
        if loaded.shape != tuple(self.weight.shape):
            raise ValueError(f"weight {name or '?'}: checkpoint shape {loaded.shape} does not "
                             f"match the model's {tuple(self.weight.shape)}")
        self.packed = loaded.pack()
        # The parameter object stays (a tied LM head holds it); its dense storage goes.
        self.weight.data = torch.empty(0, self.embedding_dim, dtype=self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(input_ids, self.weight)
        p = self.packed
        rows = torch.ops.llmkit_cpu.quant_dequantize(p.data, p.format, p.out_features,
                                                     p.in_features, p.scales,
                                                     input_ids.reshape(-1))
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kept = f", {self.packed.format}" if self.packed is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{kept}"
