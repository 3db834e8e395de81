"""Prefill/decode disaggregation for engines on one machine (``kv_transfer=shared_memory``).

A **producer** (``kv_role`` ``kv_producer`` or ``kv_both``) allocates its KV pool in a file
on a memory file system, ``<shm_dir>/<engine_id>/kv_pool.bin``, described by
``manifest.json`` (layout and KV fingerprint). A request sent with ``kv_transfer_params =
{"do_remote_decode": true}`` keeps its blocks held when it finishes; its output carries
``{"do_remote_prefill": true, "remote_engine_id", "remote_request_id", "remote_block_ids",
"remote_num_tokens", "remote_dir"}``, and a marker ``held/<key>`` says the blocks are valid.

A **consumer** (``kv_consumer`` or ``kv_both``) given those params reads the blocks straight
from the producer's pool (a pull: no copy on the producer's side) into its own, in a
background thread, while the request waits in ``WAITING_FOR_REMOTE_KVS``; then it writes
``done/<key>``, and the producer frees the blocks. The producer frees them anyway after
``transfer_timeout_s`` (and removes the marker first, so a late reader sees the blocks are
gone and recomputes instead of reading reused blocks).

Any failure on the consumer's side (no such producer, a fingerprint or layout that differs,
prompt lengths that disagree, the blocks released under it) ends the load as failed: the
request is recomputed, with the same result.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVLayout)
from llmkit.kv_transfer.loads import collect_finished_loads

if TYPE_CHECKING:
    from llmkit.request import Request

logger = logging.getLogger(__name__)

POOL_FILE, MANIFEST = "kv_pool.bin", "manifest.json"
_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def transfer_key(request_id: str) -> str:
    """A file name for a request id (ids may hold any character)."""
    return hashlib.sha1(request_id.encode()).hexdigest()[:24]


@dataclass(slots=True)
class LoadSpec:
    request_id: str
    remote: str  # where the producer is: its folder (shared_memory) or address (zmq)
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(slots=True)
class SharedMemoryMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # consumer: transfers it will not read (everything was local): the producer may free
    releases: list[tuple[str, str]] = field(default_factory=list)  # remote, remote req id
    # producer: finished requests whose blocks are held for a consumer
    sending: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.releases or self.sending)


class SharedMemoryConnector(KVConnectorBase):
    name = "shared_memory"
    #: Markers and the pool live in files under ``shm_dir`` (not so for the zmq subclass).
    uses_files = True

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout) -> None:
        super().__init__(config, role, layout)
        cfg = config.kv_transfer
        self.kv_role = cfg.kv_role
        self.is_producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = cfg.engine_id or f"engine-{os.getpid()}"
        self.dir = Path(cfg.shm_dir) / self.engine_id
        self.timeout_s = cfg.transfer_timeout_s
        self.block_size = layout.block_size
        # scheduler side
        self._pending = SharedMemoryMetadata()
        self._matched: dict[str, int] = {}  # request id -> its pool hit at the match
        # worker side
        self._held: dict[str, float] = {}  # producer: request id -> deadline
        self._loads: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._remote_pools: dict[str, list[torch.Tensor]] = {}
        self._out = KVConnectorOutput()
        if role is KVConnectorRole.SCHEDULER and self.is_producer and self.uses_files:
            for sub in ("held", "done"):  # markers of an earlier run with this id are stale
                shutil.rmtree(self.dir / sub, ignore_errors=True)
                (self.dir / sub).mkdir(parents=True, exist_ok=True)

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not (self.is_consumer and p and p.get("do_remote_prefill")):
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        # The last prompt token is computed here: its logits give the first output token.
        n = request.num_prompt_tokens - 1 - num_computed_tokens
        if request.num_output_tokens or p.get("remote_num_tokens") != request.num_prompt_tokens:
            n = 0  # resumed after preemption, or not the prompt the producer computed
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if not (self.is_consumer and p and p.get("do_remote_prefill")):
            return
        request.kv_transfer_params = None  # used once: a failed load recomputes
        hit = self._matched.pop(request.request_id, 0)
        remote_dir = self._remote_of(p)
        remote_id = str(p.get("remote_request_id", ""))
        if not num_external_tokens:
            self._pending.releases.append((remote_dir, remote_id))
            return
        bs = self.block_size
        first, end = hit // bs, -(-(hit + num_external_tokens) // bs)
        remote = list(p.get("remote_block_ids") or [])
        self._pending.loads.append(LoadSpec(request.request_id, remote_dir, remote_id,
                                            remote[first:end], block_ids[first:end]))
        self.stats.hit("remote", num_external_tokens)

    @staticmethod
    def _remote_of(params: dict[str, Any]) -> str:
        return str(params.get("remote_dir", ""))

    def build_connector_meta(self) -> SharedMemoryMetadata | None:
        meta, self._pending = self._pending, SharedMemoryMetadata()
        return None if meta.is_empty() else meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params
        if not (self.is_producer and p and p.get("do_remote_decode") and block_ids
                and request.status.name in _FINISHED_OK):
            return False, None
        # Valid from now: the consumer may be asked as soon as this output is out.
        (self.dir / "held" / transfer_key(request.request_id)).touch()
        self._pending.sending.append(request.request_id)
        return True, {"do_remote_prefill": True, "remote_engine_id": self.engine_id,
                      "remote_request_id": request.request_id,
                      "remote_block_ids": list(block_ids),
                      "remote_num_tokens": request.num_prompt_tokens,
                      "remote_dir": str(self.dir)}

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.SCHEDULER and self.is_producer:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- worker side ---------------------------------------------------------------------
    def allocate_kv_caches(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int,
                           device: torch.device | None = None) -> list[torch.Tensor] | None:
        if not self.is_producer:
            return None
        if device is not None and device.type != "cpu":
            raise ConfigError("kv_transfer.name", self.name, "", message=(
                f"shared_memory keeps the KV pool in host shared memory; platform device "
                f"{device.type!r} is not supported (use platform=cpu)"))
        self.dir.mkdir(parents=True, exist_ok=True)
        itemsize = torch.tensor([], dtype=dtype).element_size()
        per_layer = math.prod(shape)
        mm = np.memmap(self.dir / POOL_FILE, dtype=np.uint8, mode="w+",
                       shape=(num_layers * per_layer * itemsize,))
        caches = [torch.from_numpy(mm[i * per_layer * itemsize:(i + 1) * per_layer * itemsize])
                  .view(dtype).view(shape) for i in range(num_layers)]
        manifest = {"fingerprint": self.layout.fingerprint, "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."), "num_layers": num_layers,
                    "block_dim": self.layout.block_dim, "pid": os.getpid()}
        tmp = self.dir / f".{MANIFEST}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.dir / MANIFEST)
        return caches

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, SharedMemoryMetadata):
            return
        now = time.monotonic()
        for rid in meta.sending:
            self._held[rid] = now + self.timeout_s
        for remote, remote_id in meta.releases:
            self._release(remote, remote_id)
        for spec in meta.loads:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmkit-kv-load")
            self._loads[spec.request_id] = self._pool.submit(self._load, spec)

    def _release(self, remote: str, remote_request_id: str) -> None:
        """Tell the producer its blocks are not needed (nothing was read)."""
        _mark_done(Path(remote), remote_request_id)

    def _remote_caches(self, remote_dir: Path) -> list[torch.Tensor]:
        """The producer's pool, mapped read-only, after checking it holds KV of this model in
        this layout."""
        key = str(remote_dir)
        caches = self._remote_pools.get(key)
        if caches is not None:
            return caches
        manifest = json.loads((remote_dir / MANIFEST).read_text())
        mine = self.kv_caches[0]
        want = {"fingerprint": self.layout.fingerprint, "dtype": self.layout.dtype,
                "num_layers": len(self.kv_caches), "block_dim": self.layout.block_dim}
        for k, v in want.items():
            if manifest.get(k) != v:
                raise ValueError(f"producer {remote_dir} has {k}={manifest.get(k)!r}, this "
                                 f"engine {v!r}: its KV cannot be used here")
        shape = tuple(manifest["shape"])
        if shape[:self.layout.block_dim] + shape[self.layout.block_dim + 1:] != \
                tuple(mine.shape[:self.layout.block_dim]) + tuple(
                    mine.shape[self.layout.block_dim + 1:]):
            raise ValueError(f"producer {remote_dir}: block shape {shape} differs")
        dtype = getattr(torch, manifest["dtype"])
        mm = np.memmap(remote_dir / POOL_FILE, dtype=np.uint8, mode="r")
        per_layer = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        with warnings.catch_warnings():  # read-only on purpose: we never write theirs
            warnings.simplefilter("ignore", UserWarning)
            caches = [torch.frombuffer(memoryview(mm[i * per_layer:(i + 1) * per_layer]),
                                       dtype=dtype).view(shape)
                      for i in range(manifest["num_layers"])]
        self._remote_pools[key] = caches
        return caches

    def _load(self, spec: LoadSpec) -> tuple[bool, int, float]:
        """Copy the remote blocks in (the worker thread); ``(ok, blocks, seconds)``."""
        t0 = time.perf_counter()
        remote_dir = Path(spec.remote)
        held = remote_dir / "held" / transfer_key(spec.remote_request_id)
        try:
            if len(spec.remote_block_ids) != len(spec.local_block_ids):
                raise ValueError("the producer sent fewer blocks than the prompt needs")
            if not held.exists():
                raise ValueError("the producer no longer holds the blocks")
            remote = self._remote_caches(remote_dir)
            d = self.layout.block_dim
            src = torch.tensor(spec.remote_block_ids, dtype=torch.long)
            dst = torch.tensor(spec.local_block_ids, dtype=torch.long)
            for mine, theirs in zip(self.kv_caches, remote):
                mine.index_copy_(d, dst, theirs.index_select(d, src))
            if not held.exists():  # released while we read: what we copied may be reused
                raise ValueError("the producer released the blocks during the copy")
            return True, len(dst), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any failure means: recompute
            logger.warning("kv_transfer: loading request %r from %s failed (%s); it is "
                           "recomputed", spec.request_id, remote_dir, e)
            return False, 0, time.perf_counter() - t0
        finally:
            _mark_done(remote_dir, spec.remote_request_id)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        collect_finished_loads(self._loads, out, self.layout.block_nbytes)
        if self._held:
            now = time.monotonic()
            for rid, deadline in list(self._held.items()):
                key = transfer_key(rid)
                done = self.dir / "done" / key
                claimed = done.exists()
                if claimed or now >= deadline:
                    if not claimed:
                        logger.warning("kv_transfer: no consumer took request %r's KV within "
                                       "%.0f s; its blocks are freed", rid, self.timeout_s)
                    (self.dir / "held" / key).unlink(missing_ok=True)
                    done.unlink(missing_ok=True)
                    del self._held[rid]
                    out.finished_sending.append(rid)
        return out


def _mark_done(remote_dir: Path, remote_request_id: str) -> None:
    try:
        (remote_dir / "done" / transfer_key(remote_request_id)).touch()
    except OSError:
        pass  # the producer is gone: nothing waits for us
