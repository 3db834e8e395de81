"""The KV connector interface: how KV enters and leaves an engine's block pool.

vLLM's ``KVConnectorBase_V1`` split, with its names. One class, two roles, in two places:

- the **scheduler side** (``role=SCHEDULER``, in the engine core) decides: how many tokens of a
  request can be loaded from outside the pool (``get_num_new_matched_tokens``), which blocks
  they land in (``update_state_after_alloc``), what the worker must move this step
  (``build_connector_meta``), and whether a finished request's blocks must stay held until a
  receiver has them (``request_finished``);
- the **worker side** (``role=WORKER``, beside the model runner) moves bytes: loads and saves
  of blocks layer by layer (``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
  ``wait_for_save``) and reports finished asynchronous transfers (``get_finished``).

They talk only through ``KVConnectorMetadata`` (in ``SchedulerOutput.kv_connector_metadata``)
and ``KVConnectorOutput`` (in ``ModelRunnerOutput.kv_connector_output``): plain data.

Two traps the protocol encodes (seed ch. 12-13): *matching is not readiness* (a request whose
KV loads asynchronously waits in ``WAITING_FOR_REMOTE_KVS`` and its blocks are not entered in
the prefix cache until the load finished), and *compute finished is not blocks reclaimable* (a
producer's blocks stay held until the worker reports them in ``finished_sending``).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from llmkit.config.schema import EngineConfig
from llmkit.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from llmkit.request import Request

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "KVConnectorStats", "KVLayout"]


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector subclasses
    it with its own fields (plain data: it may cross a process boundary)."""

    def is_empty(self) -> bool:
        return False


@dataclass(slots=True, frozen=True)
class KVLayout:
    """How one engine's KV pool is laid out: what two engines must share to exchange blocks.

    ``fingerprint`` identifies the model and KV format (``fingerprint.py``): KV is only ever
    loaded where the fingerprint matches.
    """

    num_layers: int
    block_shape: tuple[int, ...]  # one block of one layer (the block axis removed)
    block_dim: int  # the block axis in a layer's cache tensor
    dtype: str  # torch dtype name, e.g. "float32"
    block_size: int
    fingerprint: str

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers."""
        import math

        import torch

        itemsize = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * math.prod(self.block_shape) * itemsize


@dataclass(slots=True)
class KVConnectorStats:
    """Cumulative connector counters (definitions in the README's "KV offload" section).

    - ``hits_per_tier[t]``: tokens a lookup found in tier ``t`` and that were loaded instead
      of computed (``remote`` for a disaggregated transfer); ``queries``: tokens looked up
      past the pool's own prefix hit;
    - ``loaded_blocks`` / ``loaded_bytes`` / ``load_s``: blocks written into the pool from
      outside, and the worker's time doing it; ``saved_blocks`` / ``saved_bytes``: blocks
      copied out of the pool (offloaded);
    - ``failed_loads``: requests whose load failed and that were recomputed.
    """

    queries: int = 0
    hits_per_tier: dict[str, int] = field(default_factory=dict)
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    load_s: float = 0.0
    failed_loads: int = 0

    def add_output(self, out: KVConnectorOutput) -> None:
        self.loaded_blocks += out.num_loaded_blocks
        self.loaded_bytes += out.loaded_bytes
        self.saved_blocks += out.num_saved_blocks
        self.saved_bytes += out.saved_bytes
        self.load_s += out.load_s
        self.failed_loads += len(out.failed_recving)

    def hit(self, tier: str, num_tokens: int) -> None:
        self.hits_per_tier[tier] = self.hits_per_tier.get(tier, 0) + num_tokens

    def snapshot(self) -> "KVConnectorStats":
        return KVConnectorStats(self.queries, dict(self.hits_per_tier), self.loaded_blocks,
                                self.loaded_bytes, self.saved_blocks, self.saved_bytes,
                                self.load_s, self.failed_loads)


class KVConnectorBase(ABC):
    """A KV connector; see the module docstring for the protocol.

    Built as ``cls(config, role, layout)``. The scheduler side also gets
    ``bind_block_hasher(fn)``: ``fn(request, n)`` returns the request's first ``n`` block
    hashes (the KV manager's), the keys every tier shares.
    """

    #: Set by implementations that can only serve some roles (for start-up checks).
    name: str = "base"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout) -> None:
        self.config = config
        self.role = role
        self.layout = layout
        self.stats = KVConnectorStats()
        self._block_hasher: Callable[[Request, int], list[bytes]] | None = None
        self._metadata: KVConnectorMetadata | None = None

    # -- scheduler side ------------------------------------------------------------------
    def bind_block_hasher(self, fn: Callable[[Request, int], list[bytes]]) -> None:
        self._block_hasher = fn

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the pool's own prefix hit) that can be loaded
        from outside, and whether they load asynchronously (the request then waits in
        ``WAITING_FOR_REMOTE_KVS``). At most ``request.num_tokens - 1 - num_computed_tokens``:
        the last token is always computed (its logits are needed)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request's blocks (all of them, in token order) after an allocation that made
        room for ``num_external_tokens`` loaded tokens right after its pool hit."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's work for the worker side (and forget it); None when there is none."""

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (or was aborted) holding ``block_ids``. Returns ``(delay_free,
        kv_transfer_params)``: with ``delay_free`` the scheduler keeps the blocks until the
        worker reports the request in ``finished_sending``; the params go back to the caller
        (a consumer passes them on to load the KV)."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker side's report for a step (counters, finished transfers)."""
        self.stats.add_output(output)
        self.on_connector_output(output)

    def on_connector_output(self, output: KVConnectorOutput) -> None:
        """What the scheduler side learns from the worker's report besides the counters
        (finished or failed loads, stored sizes); a ``MultiConnector`` hands it to each
        part."""

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        """``(block_id, block_hash)`` of cached blocks the pool is about to reuse: their
        content is valid until this step's forward writes new KV into them."""

    def shutdown_meta(self, cached: list[tuple[int, bytes]]) -> KVConnectorMetadata | None:
        """Last work before the engine stops, given the pool's cached blocks ``(block_id,
        block_hash)`` (a disk tier keeps them, so that a restarted engine finds them)."""
        return None

    # -- worker side ---------------------------------------------------------------------
    def allocate_kv_caches(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int,
                           device: torch.device | None = None) -> list[torch.Tensor] | None:
        """The pool's tensors, if this connector must own their memory (a shared-memory
        producer does); None = the runner allocates them."""
        return None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def start_load_kv(self) -> None:
        """Start this step's loads (before the forward)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s loads for this step are in the pool."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Start saving what this step must save of ``layer`` (after its forward)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Asynchronous transfers that finished since the last call, and this step's
        counters. ``finished_req_ids`` are the requests that ended since the last step."""
        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Release what the connector holds (files, threads)."""
