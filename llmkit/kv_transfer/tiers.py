"""The offload tiers: a size-capped LRU index of block hashes (the scheduler side's view) and
the stores that hold the bytes (the worker side's): host memory and a disk folder.

A stored block is the block of every layer, ``[num_layers, *block_shape]``. A disk file is
``MAGIC | fingerprint (32 ascii) | block hash (16) | raw bytes``; a file whose header does not
match the engine's fingerprint, hash or size is never loaded (and is removed).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"LLMKITKV1"
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
    """Blocks in host memory, by hash."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, torch.Tensor] = {}

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        self.blocks[block_hash] = data

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        return self.blocks.get(block_hash)

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        return self.blocks.pop(block_hash, None)


class DiskStore:
    """Blocks as files ``<folder>/<hash hex>.kv``; the folder is per fingerprint."""

    def __init__(self, folder: Path, fingerprint: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.folder = folder
        self.fingerprint = fingerprint.encode()
        self.shape = block_shape
        self.dtype = dtype
        self.nbytes = int(np.prod(block_shape)) * torch.tensor([], dtype=dtype).element_size()
        self.header_len = len(MAGIC) + len(self.fingerprint) + 16
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.kv"

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        final = self.path(block_hash)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + self.fingerprint + block_hash)
            f.write(data.contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, final)  # readers never see half a file

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        p = self.path(block_hash)
        try:
            raw = p.read_bytes()
        except OSError:
            return None
        head = raw[:self.header_len]
        if (head != MAGIC + self.fingerprint + block_hash
                or len(raw) != self.header_len + self.nbytes):
            logger.warning("kv_offload: %s is not a block of this model/config; removed", p)
            self.remove(block_hash)
            return None
        buf = torch.frombuffer(bytearray(raw[self.header_len:]), dtype=torch.uint8)
        return buf.view(self.dtype).view(self.shape)

    def remove(self, block_hash: bytes) -> None:
        try:
            self.path(block_hash).unlink()
        except OSError:
            pass

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
