"""How a LoRA layer adds each row's adapter delta: punica's shrink/expand by segment.

A step's rows are grouped by slot (``RowSlots``); per group, one GEMM pair: ``t = x A^T`` (all
shards of a fused projection at once: A stacks them) and ``y += t B^T`` per shard. Three
implementations of the same arithmetic:

- :class:`TorchLoRAOps`: one GEMM pair per (slot, shard) group with torch ops (the reference,
  CPUs without llmkit's kernels, and batches above the C++ kernel's limit);
- :class:`CpuLoRAOps`: llmkit's C++ ``lora_add_`` for up to
  ``dispatch.lora_small_batch_max_rows`` rows (the platform's table,
  ``llmkit.config.cpu_dispatch``): every row and shard of a layer in one call;
- :class:`TritonLoRAOps`: the SGMV kernels of ``llmkit.kernels.lora`` (GPUs; tested under
  ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.lora.base import RowSlots


@dataclass(slots=True)
class StackedLoRA:
    """One layer's adapters, one per slot, as the ops read them.

    ``a [slots, S*R, in]``: A of shard s at rows ``s*R`` (an embedding's is ``[slots, vocab,
    R]``, A transposed for row lookups); ``b [slots, R, out]``: B transposed and scaled, shard
    s's output columns ``[off[s], off[s+1])`` multiplying ``t[:, s*R:(s+1)*R]`` (rows of
    ``b`` are contiguous along the output: the expand is rank-many axpys); ``ranks [slots, S]``
    (0 = no weights for that shard: nothing is computed) on the host and as an int32 tensor on
    the device; ``out_offsets``."""

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
                   b=torch.zeros(num_slots, max_rank, offsets[-1], dtype=dtype),
                   ranks=np.zeros((num_slots, shards), dtype=np.int32),
                   ranks_device=torch.zeros(num_slots, shards, dtype=torch.int32),
                   out_offsets=offsets,
                   out_offsets_device=torch.tensor(offsets, dtype=torch.int32))

    @property
    def max_rank(self) -> int:
        return int(self.b.shape[1])

    @property
    def nbytes_per_slot(self) -> int:
        return (self.a[0].nbytes + self.b[0].nbytes)

    def set_ranks(self, slot: int, ranks: list[int]) -> None:
        self.ranks[slot] = ranks
        self.ranks_device[slot] = torch.tensor(ranks, dtype=torch.int32)


class TorchLoRAOps:
    """Per adapter, torch GEMMs (see the module docstring). Rows of one adapter that are not
    contiguous in the batch are gathered once per layer (sorted by slot) and their deltas
    added back with one scatter-add."""

    name = "torch"
    #: Whether ``add_lora_slots`` / ``add_embedding_lora_slots`` exist: LoRA inside step
    #: graphs (their inputs are tensors only).
    supports_step_graphs = False

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        """``y[row] += x[row] A[slot]^T B[slot]^T`` for every row with a slot, in place."""
        segments = rows.segments
        if all(isinstance(seg, slice) for _, seg in segments):
            for slot, seg in segments:
                self._add_segment(y[seg], x[seg], w, slot)
            return
        order, bounds = rows.sorted_rows
        xs = x.index_select(0, order)
        delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
        for slot, lo, hi in bounds:
            self._add_segment(delta[lo:hi], xs[lo:hi], w, slot)
        y.index_add_(0, order, delta)

    @staticmethod
    def _add_segment(y: torch.Tensor, x: torch.Tensor, w: StackedLoRA, slot: int) -> None:
        """``y += x A[slot]^T B[slot]^T`` for one adapter's rows (``y`` a view, in place)."""
        ranks = w.ranks[slot]
        top = int(ranks.max())
        if top == 0:
            return  # the adapter in this slot has no weights for this layer
        R, offs = w.max_rank, w.out_offsets
        if len(ranks) == 1:
            y.addmm_(x @ w.a[slot, :top].T, w.b[slot, :top])
            return
        t = x @ w.a[slot].T
        for s, rank in enumerate(ranks.tolist()):
            if rank:
                o0, o1 = offs[s], offs[s + 1]
                y[:, o0:o1].addmm_(t[:, s * R:s * R + rank], w.b[slot, :rank, o0:o1])

    def add_embedding_lora(self, y: torch.Tensor, ids: torch.Tensor, w: StackedLoRA,
                           rows: RowSlots) -> None:
        """``y[row] += A[slot][:, id]^T B[slot]^T`` (PEFT's ``F.embedding(x, A^T) @ B^T``)."""
        for slot, seg in rows.segments:
            rank = int(w.ranks[slot, 0])
            if rank == 0:
                continue
            delta = w.a[slot, ids[seg], :rank] @ w.b[slot, :rank]
            if isinstance(seg, slice):
                y[seg] += delta
            else:
                y.index_add_(0, seg, delta)


class CpuLoRAOps(TorchLoRAOps):
    """The C++ kernel up to ``dispatch.lora_small_batch_max_rows`` rows, torch GEMMs above;
    inside step graphs the kernel, with the slots as a tensor (``LoRAMapping.token_slots``).

    The two paths give different bits, so the crossover is fixed per instruction-set tier,
    never timed. ``benchmarks/test_lora_ops_bench.py`` times both on SmolLM2-135M's layers
    with four adapters interleaved: on this project's 2-core AVX2 machine the kernel was faster
    at every row count measured (1 to 2048; the torch path's gathers, scatter-add and
    per-group GEMMs cost more than their arithmetic), so by default only batches beyond the
    default step budget (2048 tokens) take torch's GEMMs."""

    name = "cpu"
    supports_step_graphs = True

    def __init__(self, kernels, dispatch: CpuDispatch | None = None) -> None:
        self.kernels = kernels
        #: Rows up to which ``lora_add_`` runs.
        self.small_batch_max_rows = (dispatch if dispatch is not None
                                     else CpuDispatch()).lora_small_batch_max_rows

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        if (rows.num_rows <= self.small_batch_max_rows and x.dtype == w.a.dtype
                and x.stride(-1) == 1 and y.stride(-1) == 1):
            self.kernels.lora_add_(y, x, w.a, w.b, rows.tensor, w.ranks_device,
                                   list(w.out_offsets))
            return
        super().add_lora(y, x, w, rows)

    def add_lora_slots(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                       slots: torch.Tensor) -> None:
        """:meth:`add_lora` with the rows' slots as an int32 tensor (-1 = base): no host
        state, so a step graph can hold it."""
        self.kernels.lora_add_(y, x, w.a, w.b, slots, w.ranks_device, list(w.out_offsets))

    def add_embedding_lora(self, y: torch.Tensor, ids: torch.Tensor, w: StackedLoRA,
                           rows: RowSlots) -> None:
        if rows.num_rows <= self.small_batch_max_rows and y.dtype == w.a.dtype:
            self.add_embedding_lora_slots(y, ids, w, rows.tensor)
            return
        super().add_embedding_lora(y, ids, w, rows)

    def add_embedding_lora_slots(self, y: torch.Tensor, ids: torch.Tensor, w: StackedLoRA,
                                 slots: torch.Tensor) -> None:
        """The embedding's delta with the slots as a tensor, by the C++ kernel: the same call
        (and so the same bits) in eager steps and in step graphs."""
        self.kernels.lora_embedding_add_(y, ids, w.a, w.b, slots, w.ranks_device)


class TritonLoRAOps(TorchLoRAOps):
    """The SGMV kernels (one shrink and one expand launch per layer); embeddings use torch."""

    name = "triton"

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, w: StackedLoRA,
                 rows: RowSlots) -> None:
        from llmkit.kernels.lora import add_lora

        add_lora(y, x, w.a, w.b, w.out_offsets_device, *rows.sorted_segments)


def lora_ops_for(device: torch.device, kernels=None,
                 dispatch: CpuDispatch | None = None) -> TorchLoRAOps:
    """The ops for a model on ``device``: Triton on CUDA, the C++ kernel on a CPU where
    llmkit's kernels are built (``kernels``; up to the rows of the platform's ``dispatch``),
    else torch."""
    if device.type == "cuda":
        return TritonLoRAOps()
    if kernels is not None and hasattr(kernels, "lora_add_"):
        return CpuLoRAOps(kernels, dispatch)
    return TorchLoRAOps()
