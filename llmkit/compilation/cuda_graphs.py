"""CUDA step graphs: the decode step captured as a CUDA graph per batch-size bucket
(``compilation.cudagraph_capture_sizes``), replayed with its inputs copied into static
buffers; a step of ``n`` rows runs the smallest bucket ``>= n``, its padding rows writing
nothing (slot -1) and reading one block. Captured at start-up, after the KV cache exists.

Not exercised on this project's CPU-only machines (tests skip without CUDA).
"""
from __future__ import annotations

import time

import torch

from llmkit.compilation.base import StepGraphs

_DEFAULT_SIZES = [1, 2, 4, 8] + list(range(16, 257, 8))


class CudaStepGraphs(StepGraphs):
    name = "cuda_graphs"

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_rows: int,
                 capture_sizes: list[int] | None = None) -> None:
        sizes = sorted({s for s in (capture_sizes or _DEFAULT_SIZES) if 1 <= s <= max_rows})
        super().__init__(model, kv_caches, sizes[-1] if sizes else 0)
        self.sizes = sizes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, torch.Tensor]] = {}
        self._pool = None

    def capture(self, block_table_width: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for rows in reversed(self.sizes):  # largest first: later graphs share its pool
                inputs = self.dummy_inputs(rows, block_table_width)
                for _ in range(2):  # warm up (allocator, autotuning) outside the capture
                    self.decode_step(*inputs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self.decode_step(*inputs)
                self._pool = graph.pool()
                self._graphs[rows] = (graph, inputs, out)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= rows)
        graph, static, out = self._graphs[size]
        s_ids, s_pos, s_slots, s_table, s_lens = static
        s_ids[:rows].copy_(input_ids)
        s_pos[:rows].copy_(positions)
        s_slots[:rows].copy_(slot_mapping)
        s_slots[rows:].fill_(-1)
        s_table[:rows, :block_table.shape[1]].copy_(block_table)
        s_lens[:rows].copy_(seq_lens)
        s_lens[rows:].fill_(1)
        graph.replay()
        return out[:rows]
