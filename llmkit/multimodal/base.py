"""What a multimodal item is once processed: where its placeholder tokens sit in the prompt,
its content hash, and its encoder input.

A ``MultiModalFeatureSpec`` (vLLM's name) is plain data — a msgspec struct of numbers, strings
and bytes — so that it crosses from the API process to the engine core like the token ids do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch


class PlaceholderRange(NamedTuple):
    """The prompt positions ``[offset, offset + length)`` an item's embeddings fill."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt: ``identifier`` is its content hash (the encoder cache's key and
    part of the prefix-cache block hashes), ``offset``/``length`` its placeholder tokens,
    ``pixel_values`` its encoder input (float32, C-order, of ``shape``); ``grid_thw`` the
    patch grid (temporal, height, width) of an encoder that takes images of any size
    (Qwen2-VL), empty for a fixed-size one."""

    identifier: str
    offset: int
    length: int
    pixel_values: bytes = b""
    shape: list[int] = []
    modality: str = "image"
    grid_thw: list[int] = []

    @property
    def mm_position(self) -> PlaceholderRange:
        return PlaceholderRange(self.offset, self.length)

    @classmethod
    def from_array(cls, identifier: str, offset: int, length: int,
                   pixels: np.ndarray, modality: str = "image",
                   grid_thw: Sequence[int] = ()) -> "MultiModalFeatureSpec":
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        return cls(identifier, offset, length, pixels.tobytes(), list(pixels.shape), modality,
                   [int(v) for v in grid_thw])

    def pixel_tensor(self) -> "torch.Tensor":
        """The encoder input as a tensor (a copy: the bytes are immutable)."""
        arr = np.frombuffer(self.pixel_values, dtype=np.float32).reshape(self.shape)
        import torch  # here: the engine process sets OpenMP's wait policy before torch loads

        return torch.from_numpy(arr.copy())
