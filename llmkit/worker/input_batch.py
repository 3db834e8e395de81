"""The persistent batch: per-request state kept across steps in preallocated arrays.

Rows are kept dense (0..num_reqs-1): removing a request moves the last row into its place, so
building a step's inputs is a handful of vectorised numpy ops, not a Python loop per token.
"""
from __future__ import annotations

import numpy as np
import torch

from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.base import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.sampling_params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, data: NewRequestData, generator: torch.Generator | None) -> int:
        if data.req_id in self.req_id_to_row:
            self.remove_request(data.req_id)
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        self.req_ids.append(data.req_id)
        self.req_id_to_row[data.req_id] = row
        n = len(data.token_ids)
        self.token_ids[row, :n] = data.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, data.block_ids)
        sp = data.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.sampling_params.append(sp)
        self.generators.append(generator)
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            self._move(last, row)
        self.req_ids.pop()
        self.sampling_params.pop()
        self.generators.pop()

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.num_blocks, self.temperature, self.top_k, self.top_p, self.min_p):
            arr[dst] = arr[src]
        rid = self.req_ids[src]
        self.req_ids[dst] = rid
        self.req_id_to_row[rid] = dst
        self.sampling_params[dst] = self.sampling_params[src]
        self.generators[dst] = self.generators[src]
