"""A step's attention metadata per KV-cache group: each group has its own block table, so its
own slot mapping (where the step's tokens are written) and block table rows; layer ``i`` reads
``metadata.for_layer(i)`` (``AttentionMetadata.group_metadata`` / ``layer_to_group``). A model
with one group never comes here.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.worker.kv_cache_setup import KVCachePlan

if TYPE_CHECKING:
    # annotation only: the batch module builds its steps' metadata here
    from llmkit.worker.input_batch import InputBatch

__all__ = ["build_group_metadata", "group_kv_metadata"]


def group_kv_metadata(metadata: AttentionMetadata, plan: KVCachePlan, batch: InputBatch,
                      rows: np.ndarray, req_idx: np.ndarray, positions: np.ndarray) -> None:
    """Set ``metadata.group_metadata``: per group, ``metadata`` with that group's block table
    rows and slot mapping (a recurrent group's: its one state block per row, and no slots,
    ``-1``: its layers write their state, not per-token rows)."""
    bs = metadata.block_size
    in_block = positions % bs
    block_idx = positions // bs
    per_group = []
    for g in range(plan.num_groups):
        table = batch.block_tables[g]
        num_blocks = int(batch.group_num_blocks[g][rows].max())
        if plan.is_recurrent(g):
            slots = np.full(len(positions), -1, dtype=np.int64)
        else:
            slots = table[req_idx, block_idx].astype(np.int64) * bs + in_block
        per_group.append(replace(metadata, block_table=torch.from_numpy(table[rows, :num_blocks]),
                                 slot_mapping=torch.from_numpy(slots)))
    metadata.group_metadata = tuple(per_group)
    metadata.layer_to_group = plan.layer_to_group


def build_group_metadata(backend: AttentionBackend, metadata: AttentionMetadata,
                         plan: KVCachePlan) -> AttentionMetadata:
    """The backend's metadata of each attention group (recurrent groups keep the plain one);
    the first group's carries them all, for the model's ``for_layer``."""
    built = tuple(m if plan.is_recurrent(g) else backend.build_metadata(m)
                  for g, m in enumerate(metadata.group_metadata))
    top = built[0]
    top.group_metadata = built
    top.layer_to_group = metadata.layer_to_group
    return top
