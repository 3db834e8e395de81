"""M-RoPE positions of the running requests (Qwen2-VL; ``models.interfaces.SupportsMRoPE``).

A prompt with images has 3 rotary positions per token (temporal, height, width), computed once
by the model when the request joins the batch (again after preemption) and sliced per step, so
chunked prefill and prefix hits read the same positions; tokens after the prompt are at
``index + delta`` in all 3 sections.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from llmkit.models.interfaces import SupportsMRoPE


class MRoPEPositions:
    def __init__(self, model: SupportsMRoPE) -> None:
        self.model = model
        # request id -> (its prompt's positions [3, prompt], the delta of those after it)
        self._tables: dict[str, tuple[np.ndarray, int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def add_request(self, req_id: str, num_prompt_tokens: int, mm_features: Sequence) -> None:
        self._tables[req_id] = self.model.get_mrope_input_positions(num_prompt_tokens,
                                                                    mm_features)

    def remove_request(self, req_id: str) -> None:
        self._tables.pop(req_id, None)

    def step_positions(self, req_ids: list[str], starts: np.ndarray, computed: np.ndarray,
                       num_sched: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The step's M-RoPE positions: a prompt's tokens from its table (whatever chunk or
        prefix hit the step starts at), later tokens at ``index + delta``. ``[tokens]`` when no
        token of the step is in a prompt with images (decode steps keep step graphs)."""
        shifted = positions.copy()
        in_prompt = []
        for i, rid in enumerate(req_ids):
            state = self._tables.get(rid)
            if state is None:
                continue
            table, delta = state
            qs, lo, n = int(starts[i]), int(computed[i]), int(num_sched[i])
            shifted[qs:qs + n] += delta
            k = min(n, table.shape[1] - lo)
            if k > 0:
                in_prompt.append((qs, lo, k, table))
        if not in_prompt:
            return shifted
        out = np.broadcast_to(shifted, (3, len(shifted))).copy()
        for qs, lo, k, table in in_prompt:
            out[:, qs:qs + k] = table[:, lo:lo + k]
        return out
