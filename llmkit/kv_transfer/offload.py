"""KV offload tiers as a connector (group ``kv_offload``): the pool's evicted blocks are kept
in host memory and/or a disk folder, keyed by their block hashes, and loaded on a prefix miss
instead of being recomputed.

- Store on eviction: when the pool reuses a cached block, the scheduler side asks the worker
  to copy it out first (the copy runs at the start of the step, before the forward writes new
  KV into the block) into the host tier, or the disk tier when there is no host tier.
- Each tier is an LRU with a byte cap. A block pushed out of the host tier moves to the disk
  tier when there is one; pushed out of the disk tier, it is gone.
- Lookup: past the pool's prefix hit, consecutive blocks found in a tier are loaded into the
  request's new blocks at the start of the step that computes the rest (a synchronous load:
  the request is scheduled at once).
- The disk tier lives in ``<disk_path>/<fingerprint>/``: it survives a restart, and a different
  model or KV format looks in another folder (and each file's header is checked on load).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVLayout)
from llmkit.kv_transfer.tiers import DISK, HOST, DiskStore, HostStore, TierIndex

if TYPE_CHECKING:
    from llmkit.request import Request

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(slots=True)
class OffloadMetadata(KVConnectorMetadata):
    """One step's offload work, done by the worker in this order (before the forward)."""

    stores: list[tuple[int, bytes, str]] = field(default_factory=list)  # block id, hash, tier
    demotes: list[bytes] = field(default_factory=list)  # host -> disk
    drops: list[tuple[bytes, str]] = field(default_factory=list)  # hash, tier
    loads: list[tuple[bytes, str, int]] = field(default_factory=list)  # hash, tier, block id

    def is_empty(self) -> bool:
        return not (self.stores or self.demotes or self.drops or self.loads)


class OffloadingConnector(KVConnectorBase):
    name = "offload"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout) -> None:
        super().__init__(config, role, layout)
        cfg = config.kv_offload
        self.block_size = layout.block_size
        self.block_nbytes = layout.block_nbytes
        dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, *layout.block_shape)
        self.disk: DiskStore | None = None
        if cfg.disk_path is not None:
            self.disk = DiskStore(Path(cfg.disk_path) / layout.fingerprint, layout.fingerprint,
                                  shape, dtype)
        # scheduler side: the index of each tier
        self.indexes: dict[str, TierIndex] = {}
        if cfg.host_gib > 0:
            self.indexes[HOST] = TierIndex(HOST, int(cfg.host_gib * GIB))
        if self.disk is not None:
            disk = self.indexes[DISK] = TierIndex(DISK, int(cfg.disk_gib * GIB))
            if role is KVConnectorRole.SCHEDULER:
                for h, n in self.disk.scan():
                    disk.add(h, n)
                if len(disk):
                    logger.info("kv_offload: %d blocks on disk in %s", len(disk),
                                self.disk.folder)
        self._pending = OffloadMetadata()
        self._matched: dict[str, tuple[int, list[tuple[bytes, str]]]] = {}
        # worker side
        self.host = HostStore()
        self._out = KVConnectorOutput()

    # -- scheduler side ------------------------------------------------------------------
    def _tier_of(self, block_hash: bytes) -> str | None:
        for name, index in self.indexes.items():
            if block_hash in index:
                return name
        return None

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs
        if start >= max_blocks or self._block_hasher is None:
            return 0, False
        hashes = self._block_hasher(request, max_blocks)
        found: list[tuple[bytes, str]] = []
        for i in range(start, max_blocks):
            h = hashes[i]
            tier = self._tier_of(h)
            if tier == DISK and not self.disk.path(h).exists():
                self.indexes[DISK].remove(h)  # removed by hand: forget it
                tier = None
            if tier is None:
                break
            found.append((h, tier))
        self._matched[request.request_id] = (start, found)
        return len(found) * bs, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        start, found = self._matched.pop(request.request_id, (0, []))
        n = num_external_tokens // self.block_size
        looked_up = (request.num_tokens - 1) // self.block_size - start
        self.stats.queries += max(looked_up, 0) * self.block_size
        for j, (h, tier) in enumerate(found[:n]):
            self.indexes[tier].touch(h)
            self._pending.loads.append((h, tier, block_ids[start + j]))
            self.stats.hit(tier, self.block_size)

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        if not self.indexes:
            return
        first_tier = HOST if HOST in self.indexes else DISK
        index = self.indexes[first_tier]
        for block_id, h in evicted:
            tier = self._tier_of(h)
            if tier is not None:  # already kept (it was loaded from there): just fresher
                self.indexes[tier].touch(h)
                continue
            index.add(h, self.block_nbytes)
            self._pending.stores.append((block_id, h, first_tier))

    def build_connector_meta(self) -> OffloadMetadata | None:
        meta = self._pending
        protected = {h for h, _, _ in meta.loads}
        host = self.indexes.get(HOST)
        disk = self.indexes.get(DISK)
        if host is not None:
            for h in host.over_capacity(protected):
                if disk is not None:
                    disk.add(h, self.block_nbytes)
                    meta.demotes.append(h)
                else:
                    meta.drops.append((h, HOST))
        if disk is not None:
            meta.drops.extend((h, DISK) for h in disk.over_capacity(protected))
        self._pending = OffloadMetadata()
        return None if meta.is_empty() else meta

    def shutdown_meta(self, cached: list[tuple[int, bytes]]) -> OffloadMetadata | None:
        """With a disk tier: the pool's cached blocks and the host tier's go to disk (the
        disk tier is the one that outlives the engine), within its cap."""
        disk = self.indexes.get(DISK)
        if disk is None:
            return None
        host = self.indexes.get(HOST)
        meta = self._pending
        if host is not None:
            for h in list(host.entries):
                host.remove(h)
                disk.add(h, self.block_nbytes)
                meta.demotes.append(h)
        for block_id, h in cached:
            if h not in disk:
                disk.add(h, self.block_nbytes)
                meta.stores.append((block_id, h, DISK))
        return self.build_connector_meta()

    def num_blocks(self, tier: str) -> int:
        """Blocks the scheduler side knows in ``tier`` (``host`` or ``disk``)."""
        index = self.indexes.get(tier)
        return len(index) if index is not None else 0

    # -- worker side ---------------------------------------------------------------------
    def _read_block(self, block_id: int) -> torch.Tensor:
        d = self.layout.block_dim
        # host memory whatever the device: the tiers are below the device's pool
        return torch.stack([kv.select(d, block_id) for kv in self.kv_caches]).to(
            "cpu", copy=True)

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata):
            return
        out = self._out
        for block_id, h, tier in meta.stores:
            data = self._read_block(block_id)
            (self.host if tier == HOST else self.disk).put(h, data)
            out.num_saved_blocks += 1
            out.saved_bytes += self.block_nbytes
        for h in meta.demotes:
            data = self.host.pop(h)
            if data is not None and self.disk is not None:
                self.disk.put(h, data)
        for h, tier in meta.drops:
            if tier == HOST:
                self.host.pop(h)
            elif self.disk is not None:
                self.disk.remove(h)
        t0 = time.perf_counter()
        d = self.layout.block_dim
        for h, tier, block_id in meta.loads:
            data = self.host.get(h) if tier == HOST else self.disk.get(h)
            if data is None:
                # Gone under us (a file removed by hand): the scheduler believed it loadable,
                # so the KV here would be wrong. Fail loudly rather than compute on garbage.
                raise RuntimeError(f"kv_offload: block {h.hex()} vanished from the {tier} tier")
            for layer, kv in enumerate(self.kv_caches):
                kv.select(d, block_id).copy_(data[layer])
            out.num_loaded_blocks += 1
            out.loaded_bytes += self.block_nbytes
        out.load_s += time.perf_counter() - t0

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        return out
