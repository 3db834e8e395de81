"""Token embedding (also the output projection when the model ties them).

Under tensor parallel the vocabulary is split (vocab-parallel): each rank holds
``ceil(vocab / tp)`` rows (the last rank's tail padded with zeros), looks up the ids in its
range, zeros the others, and one all-reduce sums the ranks' rows. A tied LM head computes with
the same shard (a column-parallel layer that gathers its logits).

A GGUF embedding in a kept block type (``model.quantization=gguf``; SmolLM2's Q8_0) stays
packed: a lookup dequantizes only the rows it needs, and a tied LM head multiplies with the
same packed rows (``llmkit/linear/quantized.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.distributed.group import TensorParallelGroup
from llmkit.kernels.cpu_native import any_loaded_cpu_kernels
from llmkit.linear.base import copy_weight
from llmkit.linear.quantized import GGUFRows


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 tp: TensorParallelGroup = TensorParallelGroup()) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.tp = tp
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self._load_param  # the sharded-parameter loader convention
        self.packed = None  # llmkit.kernels.quant.weights.PackedWeight when kept quantized

    def _load_param(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self.load_weight(loaded)

    def load_weight(self, loaded: torch.Tensor | GGUFRows, name: str = "") -> None:
        """Load the checkpoint's ``[vocab, dim]`` matrix: this rank's rows of it, or (kept GGUF
        blocks) the packed rows."""
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight {name or 'embedding'}: checkpoint shape "
                             f"{tuple(loaded.shape)} does not match the model's "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        if isinstance(loaded, GGUFRows):
            if self.tp.size > 1:
                raise ValueError("kept GGUF blocks are not split for tensor parallel: use "
                                 "model.quantization=none with parallel.tensor_parallel_size > 1")
            self.packed = loaded.pack()
            # the op of the loaded kernels' tier (a layout op: the same bits in every tier)
            self._dequantize = any_loaded_cpu_kernels().quant_dequantize
            # The parameter object stays (a tied LM head holds it); its dense storage goes.
            self.weight.data = torch.empty(0, self.embedding_dim, dtype=self.dtype)
            return
        if self.tp.size == 1:
            copy_weight(self.weight, loaded, name)
            return
        held = max(0, min(self.num_embeddings, self.start + self.rows) - self.start)
        with torch.no_grad():
            self.weight[:held].copy_(loaded[self.start:self.start + held])
            self.weight[held:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            p = self.packed
            rows = self._dequantize(p.data, p.format, p.out_features, p.in_features, p.scales,
                                    input_ids.reshape(-1))
            return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        shard = f", rows {self.start}..{self.start + self.rows}" if self.tp.size > 1 else ""
        kept = f", {self.packed.format}" if self.packed is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}{kept}"
