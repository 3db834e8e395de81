"""The packed token bitmask (xgrammar's layout) as dense masks, for checks and tests (the
sampler applies the packed form itself)."""
from __future__ import annotations

import numpy as np

__all__ = ["unpack_bitmask"]


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool ``[rows, vocab_size]`` (True = allowed) of an int32 ``[rows, ceil(V / 32)]``
    bitmask whose bit ``i`` of word ``j`` allows token ``32 * j + i``."""
    words = np.ascontiguousarray(np.atleast_2d(bitmask), dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return bits.view(bool)  # unpackbits writes 0 / 1 bytes: already bools
