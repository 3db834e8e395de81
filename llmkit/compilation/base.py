"""Step graphs: the runner-level hook that takes a decode step's Python and dispatch cost away.

A small model's decode step is dominated by what surrounds its kernels: ~10 dispatched ops per
layer, each with Python and dispatcher overhead, where the kernels themselves take microseconds.
A step graph runs the *same* model forward (the one Python source of its math) as one compiled
or captured unit: on CPUs a ``torch.compile`` graph whose nodes are the platform's C++ kernels
(opaque custom ops, so the graph computes the same bits as eager), on CUDA a CUDA graph per
batch-size bucket. Eager (``compilation.mode=eager``) is always available and is the reference.

Only decode-only steps are graphed (every scheduled request computes one token, no drafts); the
inputs are plain tensors, so the step needs no host-side metadata:
``input_ids, positions, slot_mapping [rows]``, ``block_table [rows, max_blocks]`` (the
persistent batch's full width) and ``seq_lens [rows]``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class StepGraphs(ABC):
    """Graphs of the model's decode step for batches of up to ``max_rows`` rows."""

    #: Shown in the start-up log.
    name: str = "base"
    #: Whether :meth:`capture` may run on another thread while the engine runs eager steps
    #: (the runner's background capture): it must write no KV and run nothing the engine
    #: thread runs. A CUDA graph capture may not (it records the device's stream).
    capture_in_background: bool = False

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 max_rows: int) -> None:
        self.model = model
        self.attn_backend = model.attn_backend
        self.kv_caches = kv_caches
        self.max_rows = max_rows

    def covers(self, num_rows: int) -> bool:
        return 1 <= num_rows <= self.max_rows

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
        """The eager decode step the graphs are made of: final hidden states ``[rows, H]``."""
        metadata = self.attn_backend.decode_metadata(slot_mapping, block_table, seq_lens)
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def load_saved(self, block_table_width: int) -> bool:
        """Make ready what an earlier start saved (seconds, where capturing takes minutes);
        whether every bucket is ready, so that :meth:`capture` has nothing left to do."""
        return False

    @abstractmethod
    def capture(self, block_table_width: int) -> float:
        """Compile or capture every bucket now (not inside the first requests' steps); the
        seconds it took."""

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The decode step through its graph (``covers(rows)`` must hold)."""

    def dummy_inputs(self, rows: int, block_table_width: int) -> tuple[torch.Tensor, ...]:
        """A decode step that writes nothing (slot -1) and reads block 0 (for capture)."""
        device = self.kv_caches[0].device
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        return (ids, ids.clone(), torch.full((rows,), -1, dtype=torch.int64, device=device),
                torch.zeros(rows, block_table_width, dtype=torch.int32, device=device),
                torch.ones(rows, dtype=torch.int32, device=device))
