"""A draft forward's inputs over the persistent batch: the runner's translation (positions,
slots, block tables, attention metadata) for chosen rows and token ranges.

A draft model (or EAGLE head) runs over the same rows and blocks as the target, so its inputs
are built the same way as the runner's: row r computes ``counts[r]`` tokens from position
``starts[r]``, its KV goes to its own block table's slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.spec_decode.base import ProposerBatch


@dataclass(slots=True)
class DraftInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    last: np.ndarray  # int64 [R]: each row's last token in the flat batch (its logits row)


def build_draft_inputs(batch: ProposerBatch, rows: np.ndarray, starts: np.ndarray,
                       counts: np.ndarray, block_size: int, backend: AttentionBackend,
                       device: torch.device, token_offset: int = 0) -> DraftInputs:
    """Row ``rows[i]`` computes positions ``starts[i] .. starts[i] + counts[i] - 1`` (every
    count >= 1), reading its input ids from ``batch.token_ids`` at ``position +
    token_offset`` (EAGLE's input at position p is the token at p + 1). A position past the
    row's blocks would have no slot: callers keep within them."""
    cu = np.cumsum(counts)
    total = int(cu[-1])
    first = cu - counts
    req_idx = np.repeat(rows, counts)
    positions = np.repeat(starts, counts) + (np.arange(total) - np.repeat(first, counts))
    input_ids = batch.token_ids[req_idx, positions + token_offset]
    block_numbers = batch.block_table[req_idx, positions // block_size].astype(np.int64)
    slot_mapping = block_numbers * block_size + positions % block_size
    seq_lens = starts + counts
    query_start_loc = np.concatenate(([0], cu))
    max_blocks = int(batch.num_blocks[rows].max())
    metadata = AttentionMetadata.from_host(query_start_loc, seq_lens,
                                           batch.block_table[rows, :max_blocks], slot_mapping,
                                           int(counts.max()), block_size)
    return DraftInputs(torch.from_numpy(input_ids).to(device),
                       torch.from_numpy(positions).to(device),
                       backend.build_metadata(metadata), cu - 1)
