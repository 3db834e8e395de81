"""KV offload tiers as a connector (group ``kv_offload``): the pool's evicted blocks are kept
in host memory and/or a disk folder, keyed by their block hashes, and loaded on a prefix miss
instead of being recomputed.

- Store on eviction: when the pool reuses a cached block, the scheduler side asks the worker
  to copy it out first into the host tier (encoded by ``kv_offload.host_compression``), or the
  disk tier when there is no host tier. Layer ``i`` of the block is copied out before layer
  ``i`` of this step's forward writes new KV into it.
- Each tier is an LRU with a byte cap. A block pushed out of the host tier moves to the disk
  tier when there is one; pushed out of the disk tier, it is gone.
- Lookup: past the pool's prefix hit, consecutive blocks found in a tier are loaded into the
  request's new blocks. Host-tier blocks load inside the step that computes the rest, layer
  by layer on a transfer thread while the forward runs (layer ``i`` is waited for just
  before layer ``i``: ``wait_for_layer_load``). A lookup that reaches the disk tier loads
  asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` while another thread reads
  the files, and a file that vanished or is truncated or corrupt by then fails the load: the
  request is recomputed (counted in ``failed_loads``) and its disk blocks are forgotten.
- Disk writes are write-behind (``tiers.DiskStore``): a slow disk never stalls a step.
- The disk tier lives in ``<disk_path>/<fingerprint>/``: it survives a restart, and a different
  model or KV format looks in another folder (and each file's header is checked on load).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVLayout)
from llmkit.kv_transfer.compression import BlockCodec
from llmkit.kv_transfer.loads import collect_finished_loads
from llmkit.kv_transfer.tiers import DISK, HOST, DiskStore, HostStore, TierIndex

if TYPE_CHECKING:
    from llmkit.request import Request

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(slots=True)
class RequestLoad:
    """A request's asynchronous load: ``(block hash, tier, pool block id)`` in token order."""

    request_id: str
    blocks: list[tuple[bytes, str, int]]


@dataclass(slots=True)
class OffloadMetadata(KVConnectorMetadata):
    """One step's offload work, done by the worker in this order."""

    stores: list[tuple[int, bytes, str]] = field(default_factory=list)  # block id, hash, tier
    loads: list[tuple[bytes, str, int]] = field(default_factory=list)  # hash, tier, block id
    demotes: list[bytes] = field(default_factory=list)  # host -> disk
    drops: list[tuple[bytes, str]] = field(default_factory=list)  # hash, tier
    async_loads: list[RequestLoad] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.stores or self.demotes or self.drops or self.loads
                    or self.async_loads)


class StepTransfer:
    """One step's transfers on the transfer thread: which layers are ready, or why none
    will be."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready = -1  # layers 0..ready are in the pool
        self._error: BaseException | None = None
        self._done = False

    def layer_ready(self, layer: int) -> None:
        with self._cond:
            self._ready = layer
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._done = True
            self._error = error
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._ready >= layer or self._done)
            if self._error is not None:
                raise RuntimeError("kv_offload: this step's KV transfer failed") \
                    from self._error

    def wait_done(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done)
            if self._error is not None:
                raise RuntimeError("kv_offload: this step's KV transfer failed") \
                    from self._error


class OffloadingConnector(KVConnectorBase):
    name = "offload"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout) -> None:
        super().__init__(config, role, layout)
        cfg = config.kv_offload
        self.block_size = layout.block_size
        self.block_nbytes = layout.block_nbytes
        self.dtype = getattr(torch, layout.dtype)
        self.block_shape = (layout.num_layers, *layout.block_shape)
        self.disk: DiskStore | None = None
        if cfg.disk_path is not None:
            self.disk = DiskStore(Path(cfg.disk_path) / layout.fingerprint, layout.fingerprint,
                                  self.block_shape, self.dtype, self.block_nbytes)
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
        # request id -> (hash, tier) of the blocks it loads asynchronously
        self._loading: dict[str, list[tuple[bytes, str]]] = {}
        # worker side
        self.host = HostStore(BlockCodec(cfg.host_compression))
        self._out = KVConnectorOutput()
        self._out_lock = threading.Lock()
        self._transfer: ThreadPoolExecutor | None = None  # step transfers, in step order
        self._io: ThreadPoolExecutor | None = None  # asynchronous (disk) loads
        self._step: StepTransfer | None = None
        self._loads: dict[str, Future] = {}

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
            tier = self._tier_of(hashes[i])
            if tier is None:
                break
            found.append((hashes[i], tier))
        self._matched[request.request_id] = (start, found)
        # A file may vanish or rot before it is read: a disk load is asynchronous, so that
        # its failure can still turn into a recompute.
        return len(found) * bs, any(tier == DISK for _, tier in found)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        start, found = self._matched.pop(request.request_id, (0, []))
        n = num_external_tokens // self.block_size
        looked_up = (request.num_tokens - 1) // self.block_size - start
        self.stats.queries += max(looked_up, 0) * self.block_size
        blocks = []
        for j, (h, tier) in enumerate(found[:n]):
            self.indexes[tier].touch(h)
            blocks.append((h, tier, block_ids[start + j]))
        if any(tier == DISK for _, tier, _ in blocks):
            # counted as hits once loaded (on_connector_output)
            self._pending.async_loads.append(RequestLoad(request.request_id, blocks))
            self._loading[request.request_id] = [(h, tier) for h, tier, _ in blocks]
        else:
            self._pending.loads.extend(blocks)
            for _, tier, _ in blocks:
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

    def on_connector_output(self, output: KVConnectorOutput) -> None:
        host = self.indexes.get(HOST)
        if host is not None:
            for h, n in output.stored_nbytes.items():
                host.resize(h, n)
        failed = set(output.failed_recving)
        for rid in output.finished_recving:
            blocks = self._loading.pop(rid, None)
            if blocks is None:
                continue
            if rid not in failed:
                for _, tier in blocks:
                    self.stats.hit(tier, self.block_size)
                continue
            # Some file of it was gone or unsound: forget its disk blocks (so that the
            # recompute is not matched to them again) and remove what is left of them.
            for h, tier in blocks:
                if tier == DISK and h in self.indexes[DISK]:
                    self.indexes[DISK].remove(h)
                    self._pending.drops.append((h, DISK))

    def build_connector_meta(self) -> OffloadMetadata | None:
        meta = self._pending
        protected = {h for h, _, _ in meta.loads}
        for blocks in self._loading.values():
            protected.update(h for h, _ in blocks)
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
    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata) or meta.is_empty():
            self._step = None
            return
        if self._transfer is None:
            self._transfer = ThreadPoolExecutor(1, thread_name_prefix="llmkit-kv-offload")
        step = self._step = StepTransfer()
        self._transfer.submit(self._run_step, meta, step)

    def wait_for_layer_load(self, layer: int) -> None:
        if self._step is not None:
            self._step.wait_layer(layer)

    def wait_for_save(self) -> None:
        # The step's stores are in their tiers (disk writes still queued: write-behind).
        if self._step is not None:
            self._step.wait_done()
            self._step = None

    def _run_step(self, meta: OffloadMetadata, step: StepTransfer) -> None:
        """The transfer thread: per layer, copy out the blocks to store, then copy in the
        host-tier loads (a block evicted this step may be the very block a load fills);
        then file the stored blocks and move or drop what the caps push out."""
        try:
            with torch.inference_mode():
                self._transfer_step(meta, step)
        except BaseException as e:  # noqa: BLE001 - the step's waiter raises it
            step.finish(e)
            return
        step.finish()

    def _transfer_step(self, meta: OffloadMetadata, step: StepTransfer) -> None:
        t0 = time.perf_counter()
        stores = [(block_id, h, tier, torch.empty(self.block_shape, dtype=self.dtype))
                  for block_id, h, tier in meta.stores]
        loads = []
        for h, tier, block_id in meta.loads:
            data = self.host.get(h)
            if data is None:  # the scheduler's index and this store disagree: a bug
                raise RuntimeError(f"block {h.hex()} is not in the host tier")
            loads.append((block_id, data))
        for layer in range(len(self.kv_caches)):
            self._transfer_layer(layer, stores, loads)
            step.layer_ready(layer)
        load_s = time.perf_counter() - t0
        stored: dict[bytes, int] = {}
        for _, h, tier, buf in stores:
            if tier == HOST:
                stored[h] = self.host.put(h, buf)
            else:
                self.disk.put(h, buf)
        for h in meta.demotes:
            data = self.host.pop(h)
            if data is not None and self.disk is not None:
                self.disk.put(h, data)
        for h, tier in meta.drops:
            if tier == HOST:
                self.host.discard(h)
            elif self.disk is not None:
                self.disk.remove(h)
        for load in meta.async_loads:
            # Host blocks are taken now, before a later step may drop them.
            host_data = {h: self.host.get(h) for h, tier, _ in load.blocks if tier == HOST}
            if self._io is None:
                self._io = ThreadPoolExecutor(1, thread_name_prefix="llmkit-kv-disk-load")
            self._loads[load.request_id] = self._io.submit(self._load_request, load,
                                                           host_data)
        with self._out_lock:
            out = self._out
            out.num_saved_blocks += len(stores)
            out.saved_bytes += len(stores) * self.block_nbytes
            out.num_loaded_blocks += len(loads)
            out.loaded_bytes += len(loads) * self.block_nbytes
            out.load_s += load_s
            if stored:
                out.stored_nbytes = {**out.stored_nbytes, **stored}

    def _transfer_layer(self, layer: int, stores: list, loads: list) -> None:
        kv, d = self.kv_caches[layer], self.layout.block_dim
        for block_id, _, _, buf in stores:
            buf[layer].copy_(kv.select(d, block_id))
        for block_id, data in loads:
            kv.select(d, block_id).copy_(data[layer])

    def _load_request(self, load: RequestLoad,
                      host_data: dict[bytes, torch.Tensor | None]) -> tuple[bool, int, float]:
        """The disk-load thread: read every block first (a missing or unsound one fails the
        whole load: the request recomputes), then copy them into the request's blocks."""
        t0 = time.perf_counter()
        try:
            data = []
            for h, tier, block_id in load.blocks:
                block = host_data.get(h) if tier == HOST else self.disk.get(h)
                if block is None:
                    logger.warning("kv_offload: block %s of request %r is gone from the %s "
                                   "tier or unsound; the request is recomputed", h.hex(),
                                   load.request_id, tier)
                    return False, 0, time.perf_counter() - t0
                data.append((block_id, block))
            d = self.layout.block_dim
            with torch.inference_mode():
                for layer, kv in enumerate(self.kv_caches):
                    for block_id, block in data:
                        kv.select(d, block_id).copy_(block[layer])
            return True, len(data), time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - any failure means: recompute
            logger.exception("kv_offload: loading request %r failed; it is recomputed",
                             load.request_id)
            return False, 0, time.perf_counter() - t0

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        with self._out_lock:
            out, self._out = self._out, KVConnectorOutput()
        if self._loads:
            collect_finished_loads(self._loads, out, self.block_nbytes)
        return out

    def shutdown(self) -> None:
        for pool in (self._transfer, self._io):
            if pool is not None:
                pool.shutdown(wait=True)
        self._transfer = self._io = None
        if self.disk is not None:
            self.disk.close()
