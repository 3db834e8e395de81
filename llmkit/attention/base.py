"""The attention backend interface: how K/V are laid out in the paged cache and how a step's
attention is computed over it. Metadata is built once per step and passed down explicitly."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Hashable, Protocol

import numpy as np
import torch

from llmkit.ops.base import ModelOps


class KVLayerHook(Protocol):
    """Per-layer KV transfer calls a model makes inside its layer loop (vLLM's
    ``wait_for_layer_load`` / ``save_kv_layer``): a KV connector's worker side. Layer ``i``'s
    loaded KV is waited for just before layer ``i`` runs, and its KV handed over for saving
    just after, so that the next layers' transfers proceed while this one computes."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None: ...


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer.

    Tokens of request i occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v; the
    request has ``seq_lens[i]`` tokens of context once this step's tokens are written (its
    cached prefix plus the new ones). ``slot_mapping[t]`` is where token t's K/V go in the
    flattened cache (-1 = do not write), and ``block_table[i]`` lists request i's blocks.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # Host copies, for backends that loop or branch on the CPU.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # The step's KV connector hook (set by the model runner on the built metadata; None when
    # no connector runs or the step's transfers were waited for before the forward).
    kv_layer_hook: KVLayerHook | None = None
    # KV-cache groups (``llmkit.attention.kv_spec``): a model whose layers keep different
    # state has one metadata per group (its own block table and slot mapping), and layer i
    # reads ``group_metadata[layer_to_group[i]]``. Empty for one group: this metadata serves
    # every layer.
    group_metadata: tuple["AttentionMetadata", ...] = ()
    layer_to_group: tuple[int, ...] = ()
    # What the first layer to need it derives from this step's metadata, kept for the other
    # layers (device copies of the tensors, split counts, tile maps): ``{key: value}``, each
    # key naming its maker (``("mla_tables", device)``). Never copied (``init=False``): a
    # metadata made from another (a group's, a backend's) may hold other tensors.
    derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  block_table: np.ndarray, slot_mapping: np.ndarray, max_query_len: int,
                  block_size: int) -> "AttentionMetadata":
        """A step's metadata from the host arrays a batch is translated into (the runner's
        step, a draft forward's): ``query_start_loc`` ``[R + 1]`` from 0, ``seq_lens`` ``[R]``,
        ``block_table`` int32 ``[R, >= blocks used]``, ``slot_mapping`` int64 ``[T]``. The
        tensors share the arrays' memory where the dtype allows."""
        return cls(
            num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=block_size,
        )

    def base_fields(self) -> dict[str, Any]:
        """The :class:`AttentionMetadata` fields a backend's metadata built from this one
        copies (all but ``derived``)."""
        return {f.name: getattr(self, f.name) for f in fields(AttentionMetadata) if f.init}

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer ``layer`` (its index in the model's layer list) reads."""
        if not self.group_metadata:
            return self
        return self.group_metadata[self.layer_to_group[layer]]


class AttentionBackend(ABC):
    """Stateless per-layer attention over a paged KV cache.

    ``q`` is ``[num_tokens, num_heads, head_dim]``, ``k`` and ``v`` are
    ``[num_tokens, num_kv_heads, head_dim]``; ``num_heads`` is a multiple of ``num_kv_heads``
    (grouped-query attention). The result has ``q``'s shape.
    """

    name: str = "base"
    #: ``kv_cache.cache_dtype`` values this backend reads: a cache of another dtype than the
    #: model's (a narrower float, or int8/fp8 codes with row scales, ``llmkit.kernels.kv_quant``)
    #: needs readers that convert or dequantize it; others fail at start-up.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def __init__(self, ops: ModelOps | None = None) -> None:
        # The platform's ops (KV write, paged decode attention); the torch reference if None.
        self.ops = ops if ops is not None else ModelOps()

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor; index 0 selects K (0) or V (1). ``head_dim`` is
        the row's width: a quantized cache's rows are ``head_dim + 4`` bytes (the runner
        passes ``llmkit.kernels.kv_quant.cache_row_width``)."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def for_platform(cls, platform, ops: ModelOps | None = None) -> "AttentionBackend":
        """This backend as ``platform`` (a ``llmkit.platforms.Platform``) builds it: with its
        ``ops`` and, for backends that read it, its dispatch table (``platform.dispatch``)."""
        return cls(ops)

    @classmethod
    def check_available(cls, platform) -> str | None:
        """Why this backend cannot run on ``platform`` (a ``llmkit.platforms.Platform``), or
        ``None`` when it can. Asked when the engine is assembled, so that an unusable choice
        fails at start-up as a config error naming ``attention``."""
        return None

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Backends that need more per-step data (split plans, tile maps) extend it here."""
        return metadata

    #: Whether ``decode_metadata`` exists: a decode step of this backend can be a step graph.
    supports_step_graphs: bool = False

    def decode_metadata(self, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor) -> AttentionMetadata:
        """The metadata of a decode-only step (one token per row) built from tensors alone,
        inside a step graph: ``block_table [rows, max_blocks]`` may be wider than needed."""
        raise NotImplementedError(f"attention backend {self.name!r} has no graph-safe decode "
                                  "path")

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """Called once the KV cache exists: compile or load kernels here, not in the first
        steps (the default has nothing to prepare)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Write this step's K/V, then attend. ``sliding_window=W``: the query at position p
        sees keys ``p - W + 1 .. p`` only, and no block wholly before that is read (a
        sliding-window group's block table may hold freed blocks' ids there);
        ``logits_soft_cap=c``: scaled scores become ``c * tanh(s / c)`` before the softmax
        (``llmkit.ops.masking``)."""
