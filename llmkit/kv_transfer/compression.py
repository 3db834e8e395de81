"""Lossless encodings of offloaded KV blocks (``kv_offload.host_compression``).

``none`` keeps the tensor. ``zlib`` and ``zstd`` byte-shuffle it first (byte ``j`` of every
element side by side: the sign/exponent bytes of float KV are alike, the mantissa bytes
noise) and then compress; ``zstd`` needs the ``zstandard`` package."""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

CODECS = ("none", "zlib", "zstd")


@dataclass(slots=True, frozen=True)
class EncodedBlock:
    payload: bytes
    shape: tuple[int, ...]
    dtype: torch.dtype


class BlockCodec:
    """Encodes and decodes one block; not thread-safe (one per store, used by one thread)."""

    def __init__(self, name: str, level: int | None = None) -> None:
        if name not in CODECS:
            raise ValueError(f"unknown KV block codec {name!r} (one of {', '.join(CODECS)})")
        self.name = name
        self._compress = self._decompress = None
        if name == "zlib":
            lvl = 1 if level is None else level
            self._compress = lambda b: zlib.compress(b, lvl)
            self._decompress = zlib.decompress
        elif name == "zstd":
            import zstandard

            c = zstandard.ZstdCompressor(level=1 if level is None else level)
            d = zstandard.ZstdDecompressor()
            self._compress, self._decompress = c.compress, d.decompress

    def encode(self, data: torch.Tensor) -> torch.Tensor | EncodedBlock:
        if self._compress is None:
            return data
        size = data.element_size()
        shuffled = data.contiguous().view(torch.uint8).view(-1, size).t().contiguous()
        return EncodedBlock(self._compress(shuffled.numpy().tobytes()), tuple(data.shape),
                            data.dtype)

    def decode(self, encoded: torch.Tensor | EncodedBlock) -> torch.Tensor:
        if isinstance(encoded, torch.Tensor):
            return encoded
        raw = torch.frombuffer(bytearray(self._decompress(encoded.payload)), dtype=torch.uint8)
        size = torch.tensor([], dtype=encoded.dtype).element_size()
        return raw.view(size, -1).t().contiguous().view(encoded.dtype).view(encoded.shape)

    @staticmethod
    def nbytes(encoded: torch.Tensor | EncodedBlock) -> int:
        if isinstance(encoded, torch.Tensor):
            return encoded.numel() * encoded.element_size()
        return len(encoded.payload)
