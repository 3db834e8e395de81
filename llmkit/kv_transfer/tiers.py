"""The offload tiers: a size-capped LRU index of block hashes (the scheduler side's view) and
the stores that hold the bytes (the worker side's): host memory and a disk folder.

A stored block is the block of every layer, ``[num_layers, *block_shape]``. A disk file is
``MAGIC | fingerprint (32 ascii) | block hash (16) | crc32 of the bytes (4) | raw bytes``; a
file whose header, size or checksum does not match is never loaded (and is removed): a
vanished, truncated or corrupt file is a miss, never garbage in the pool.

Disk writes are write-behind: ``put`` queues the block for a writer thread and returns, so a
slow disk never stalls a step; until written, ``get`` serves the queued block.
"""
from __future__ import annotations

import logging
import os
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from llmkit.kv_transfer.compression import BlockCodec

logger = logging.getLogger(__name__)

MAGIC = b"LLMKITKV2"
HOST, DISK = "host", "disk"


class TierIndex:
    """Which block hashes a tier holds, least recently used first, and their bytes."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, block_hash: bytes, nbytes: int) -> None:
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return
        self.entries[block_hash] = nbytes
        self.used_bytes += nbytes

    def resize(self, block_hash: bytes, nbytes: int) -> None:
        """The block's real size in the tier (compressed), once the worker knows it."""
        old = self.entries.get(block_hash)
        if old is not None:
            self.entries[block_hash] = nbytes
            self.used_bytes += nbytes - old

    def touch(self, block_hash: bytes) -> None:
        self.entries.move_to_end(block_hash)

    def remove(self, block_hash: bytes) -> None:
        self.used_bytes -= self.entries.pop(block_hash)

    def over_capacity(self, protected: set[bytes]) -> list[bytes]:
        """Pop least recently used entries (never ``protected`` ones) until under the cap."""
        out: list[bytes] = []
        for h in list(self.entries):
            if self.used_bytes <= self.capacity_bytes:
                break
            if h in protected:
                continue
            self.remove(h)
            out.append(h)
        return out


class HostStore:
    """Blocks in host memory, by hash, encoded by ``codec`` (``kv_offload.host_compression``).
    Used from the worker side's transfer thread only."""

    def __init__(self, codec: BlockCodec | None = None) -> None:
        self.codec = codec if codec is not None else BlockCodec("none")
        self.blocks: dict[bytes, object] = {}

    def put(self, block_hash: bytes, data: torch.Tensor) -> int:
        """Keep ``data``; returns the bytes it takes here."""
        encoded = self.codec.encode(data)
        self.blocks[block_hash] = encoded
        return self.codec.nbytes(encoded)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        encoded = self.blocks.get(block_hash)
        return None if encoded is None else self.codec.decode(encoded)

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        encoded = self.blocks.pop(block_hash, None)
        return None if encoded is None else self.codec.decode(encoded)

    def discard(self, block_hash: bytes) -> None:
        """Drop the block without decoding it."""
        self.blocks.pop(block_hash, None)


class DiskStore:
    """Blocks as files ``<folder>/<hash hex>.kv``; the folder is per fingerprint.

    ``nbytes`` is the layout's bytes per block (``KVLayout.block_nbytes``, the one place that
    counts them). ``put``/``remove`` run on a writer thread in order; ``get`` may run on any
    thread."""

    def __init__(self, folder: Path, fingerprint: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype, nbytes: int) -> None:
        self.folder = folder
        self.fingerprint = fingerprint.encode()
        self.shape = block_shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.header_len = len(MAGIC) + len(self.fingerprint) + 16 + 4
        folder.mkdir(parents=True, exist_ok=True)
        self._queued: dict[bytes, torch.Tensor] = {}  # put, not yet on disk
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        self._last_write: Future | None = None

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.kv"

    def _submit(self, fn, *args) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="llmkit-kv-disk")
        self._last_write = self._writer.submit(fn, *args)

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        with self._lock:
            self._queued[block_hash] = data
        self._submit(self._write, block_hash, data)

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        with self._lock:
            if self._queued.get(block_hash) is not data:
                return  # removed (or put again) since
        final = self.path(block_hash)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        try:
            payload = data.contiguous().view(torch.uint8).numpy().tobytes()
            with open(tmp, "wb") as f:
                f.write(MAGIC + self.fingerprint + block_hash
                        + zlib.crc32(payload).to_bytes(4, "little"))
                f.write(payload)
            with self._lock:
                if self._queued.get(block_hash) is data:
                    os.replace(tmp, final)  # readers never see half a file
                    del self._queued[block_hash]
                    return
            tmp.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("kv_offload: writing %s failed (%s); the block is not kept", final, e)
            tmp.unlink(missing_ok=True)
            with self._lock:
                if self._queued.get(block_hash) is data:
                    del self._queued[block_hash]

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block, or None if it is not here or its file is not a sound block of this
        model/config (then the file is removed)."""
        with self._lock:
            queued = self._queued.get(block_hash)
        if queued is not None:
            return queued
        p = self.path(block_hash)
        try:
            raw = p.read_bytes()
        except OSError:
            return None
        h = self.header_len
        if (raw[:h - 4] != MAGIC + self.fingerprint + block_hash
                or len(raw) != h + self.nbytes
                or zlib.crc32(memoryview(raw)[h:]) != int.from_bytes(raw[h - 4:h], "little")):
            logger.warning("kv_offload: %s is truncated, corrupt or not a block of this "
                           "model/config; removed", p)
            p.unlink(missing_ok=True)
            return None
        buf = torch.frombuffer(bytearray(raw[h:]), dtype=torch.uint8)
        return buf.view(self.dtype).view(self.shape)

    def remove(self, block_hash: bytes) -> None:
        with self._lock:
            self._queued.pop(block_hash, None)
        self._submit(self._unlink, block_hash)

    def _unlink(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._queued:
                return  # put again since: that write wins
        self.path(block_hash).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write and removal is on disk."""
        if self._last_write is not None:
            self._last_write.result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def scan(self) -> list[tuple[bytes, int]]:
        """``(hash, bytes)`` of the files here, oldest first (the LRU order to resume)."""
        found = []
        for p in self.folder.glob("*.kv"):
            try:
                h = bytes.fromhex(p.stem)
                st = p.stat()
            except (ValueError, OSError):
                continue
            if len(h) == 16 and st.st_size == self.header_len + self.nbytes:
                found.append((st.st_mtime_ns, h, self.nbytes))
        found.sort()
        return [(h, n) for _, h, n in found]
