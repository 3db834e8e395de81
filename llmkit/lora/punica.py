"""How a LoRA layer adds each row's adapter delta: punica's shrink/expand by segment.

A step's rows are grouped by slot (``RowSlots``); per group, one GEMM pair: ``t = x A^T`` (all
shards of a fused projection at once: A stacks them) and ``y += t B^T`` per shard. Three
implementations of the same arithmetic:

- :class:`TorchLoRAOps`: one GEMM pair per (slot, shard) group with torch ops (the reference,
  and what large CPU batches run: their GEMMs dominate the per-op overhead);
- :class:`CpuLoRAOps`: llmkit's C++ ``lora_add_`` for up to ``small_batch_max_rows`` rows
  (decoding): every row and shard of a layer in one call;
- :class:`TritonLoRAOps`: the SGMV kernels of ``llmkit.kernels.lora`` (GPUs; tested under
  ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.lora.base import RowSlots


@dataclass(slots=True)
class StackedLoRA:
    """One layer's adapters, one per slot, as the ops read them.

    ``a [slots, S*R, in]`` (shard s's rows at ``s*R``; an embedding's is ``[slots, vocab, R]``,
    A transposed for row lookups), ``b [slots, out, R]`` (scaled), ``ranks [slots, S]`` (0 = no
    weights for that shard: nothing is computed) on the host and as an int32 tensor on the
    device, ``out_offsets`` (shard s's outputs are ``[off[s], off[s+1])``)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: np.ndarray
    ranks_device: torch.Tensor
    out_offsets: tuple[int, ...]
    out_offsets_device: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, max_rank: int, in_features: int,
              output_sizes: tuple[int, ...], dtype: torch.dtype,
              embedding: bool = False) -> "StackedLoRA":
        """Zeroed buffers on the current default device (the model's, while it is built)."""
        shards = len(output_sizes)
        offsets = tuple(int(v) for v in np.concatenate(([0], np.cumsum(output_sizes))))
        a_shape = ((num_slots, in_features, max_rank) if embedding
                   else (num_slots, shards * max_rank, in_features))
        return cls(a=torch.zeros(a_shape, dtype=dtype),
                   b=torch.zeros(num_slots, offsets[-1], max_rank, dtype=dtype),
                   ranks=np.zeros((num_slots, shards), dtype=np.int32),
                   ranks_device=torch.zeros(num_slots, shards, dtype=torch.int32),
                   out_offsets=offsets,
                   out_offsets_device=torch.tensor(offsets, dtype=torch.int32))

    @property
    def max_rank(self) -> int:
        return int(self.b.shape[2])

    @property
    def nbytes_per_slot(self) -> int:
        return (self.a[0].nbytes + self.b[0].nbytes)

    def set_ranks(self, slot: int, ranks: list[int]) -> None:
        self.ranks[slot] = ranks
        self.ranks_device[slot] = torch.tensor(ranks, dtype=torch.int32)


class TorchLoRAOps:
    """Per (slot, shard) group, torch GEMMs (see the module docstring)."""

    name = "torch"

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        """``y[row] += x[row] A[slot]^T B[slot]^T`` for every row with a slot, in place."""
        R = w.max_rank
        offs = w.out_offsets
        for slot, seg in rows.segments:
            ranks = w.ranks[slot]
            top = int(ranks.max())
            if top == 0:
                continue  # the adapter in this slot has no weights for this layer
            xs = x[seg]
            if len(ranks) == 1:
                t = xs @ w.a[slot, :top].T
            else:
                t = xs @ w.a[slot].T
            for s, rank in enumerate(ranks.tolist()):
                if rank == 0:
                    continue
                o0, o1 = offs[s], offs[s + 1]
                ts = t[:, :rank] if len(ranks) == 1 else t[:, s * R:s * R + rank]
                delta = ts @ w.b[slot, o0:o1, :rank].T
                if isinstance(seg, slice):
                    y[seg, o0:o1] += delta
                else:
                    y[:, o0:o1].index_add_(0, seg, delta)

    def add_embedding_lora(self, y: torch.Tensor, ids: torch.Tensor, w: StackedLoRA,
                           rows: RowSlots) -> None:
        """``y[row] += A[slot][:, id]^T B[slot]^T`` (PEFT's ``F.embedding(x, A^T) @ B^T``)."""
        for slot, seg in rows.segments:
            rank = int(w.ranks[slot, 0])
            if rank == 0:
                continue
            t = w.a[slot, ids[seg], :rank]
            delta = t @ w.b[slot, :, :rank].T
            if isinstance(seg, slice):
                y[seg] += delta
            else:
                y.index_add_(0, seg, delta)


class CpuLoRAOps(TorchLoRAOps):
    """The C++ kernel for small batches, torch GEMMs above."""

    name = "cpu"
    #: Rows up to which ``lora_add_`` runs (``benchmarks/test_lora_bench.py`` measures the
    #: crossover against the torch groups).
    small_batch_max_rows = 8

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        if (rows.num_rows <= self.small_batch_max_rows and x.dtype == w.a.dtype
                and x.stride(-1) == 1 and y.stride(-1) == 1):
            self.kernels.lora_add_(y, x, w.a, w.b, rows.tensor, w.ranks_device,
                                   list(w.out_offsets))
            return
        super().add_lora(y, x, w, rows)


class TritonLoRAOps(TorchLoRAOps):
    """The SGMV kernels (one shrink and one expand launch per layer); embeddings use torch."""

    name = "triton"

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        from llmkit.kernels.lora import add_lora

        add_lora(y, x, w.a, w.b, w.out_offsets_device, *rows.sorted_segments)


def lora_ops_for(device: torch.device, kernels=None) -> TorchLoRAOps:
    """The ops for a model on ``device``: Triton on CUDA, the C++ kernel on a CPU where
    llmkit's kernels are built (``kernels``), else torch."""
    if device.type == "cuda":
        return TritonLoRAOps()
    if kernels is not None and hasattr(kernels, "lora_add_"):
        return CpuLoRAOps(kernels)
    return TorchLoRAOps()
