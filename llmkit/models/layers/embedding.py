"""Token embedding (also the output projection when the model ties them).

Under tensor parallel the vocabulary is split (vocab-parallel): each rank holds
``ceil(vocab / tp)`` rows (the last rank's tail padded with zeros), looks up the ids in its
range, zeros the others, and one all-reduce sums the ranks' rows. A tied LM head computes with
the same shard (a column-parallel layer that gathers its logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.distributed.group import TensorParallelGroup


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 tp: TensorParallelGroup = TensorParallelGroup()) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp = tp
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, dim]`` matrix."""
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not match "
                             f"the model's {(self.num_embeddings, self.embedding_dim)}")
        held = max(0, min(self.num_embeddings, self.start + self.rows) - self.start)
        with torch.no_grad():
            param[:held].copy_(loaded[self.start:self.start + held])
            param[held:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        shard = f", rows {self.start}..{self.start + self.rows}" if self.tp.size > 1 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}"
