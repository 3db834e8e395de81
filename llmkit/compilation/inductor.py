"""CPU step graphs: the decode step compiled by ``torch.compile`` (inductor).

The platform's C++ kernels are custom ops with fake implementations, so inductor keeps them as
opaque calls and the graph computes exactly what eager computes (same kernels, same order, same
bits); what goes is the Python around them (module calls, the attention backend's branches,
the linear methods' row dispatch). With inductor's C++ wrapper (``compilation.cpp_wrapper``,
the default) the graph calls the kernels from C++.

Two graphs cover 1..``max_rows`` rows: one for a single row and one dynamic in the row count
for 2..``max_rows`` (dynamo specialises sizes 0 and 1). Inductor caches compiled graphs on
disk (``compilation.cache_dir``), so only the first start-up pays the full compile.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from llmkit.compilation.base import StepGraphs

logger = logging.getLogger(__name__)

# Checks inductor inserts around every op call at run time; the graph's inputs are built by
# the runner with fixed layouts, so they only cost time (~1 us a call, hundreds a step).
_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


class InductorStepGraphs(StepGraphs):
    name = "inductor"

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_rows: int,
                 *, cpp_wrapper: bool = True, cache_dir: str | None = None) -> None:
        super().__init__(model, kv_caches, max_rows)
        if cache_dir is not None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            # inductor reads its cache folder from the environment, at compile time
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        options = dict(_OPTIONS, cpp_wrapper=cpp_wrapper)
        self.cpp_wrapper = cpp_wrapper
        self._fn = torch.compile(self.decode_step, fullgraph=True, dynamic=False,
                                 options=options)

    def capture(self, block_table_width: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for rows in sorted({1, min(2, self.max_rows), self.max_rows}):
                self.run(*self.dummy_inputs(rows, block_table_width))
        return time.perf_counter() - t0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        if rows >= 2:
            mark = torch._dynamo.mark_dynamic
            for t in (input_ids, positions, slot_mapping, block_table, seq_lens):
                mark(t, 0, min=2, max=self.max_rows)
        return self._fn(input_ids, positions, slot_mapping, block_table, seq_lens)
