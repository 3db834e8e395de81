"""Random GGUF weight rows in every kept block format, for tests and benchmarks.

Q4_0, Q4_1 and Q8_0 rows are quantized from random floats by gguf-py's own quantizer. gguf-py
cannot quantize Q4_K or Q6_K, so their rows are random *valid* blocks: random bytes wherever
every bit pattern is a valid value (the 4/6-bit quants, the packed 6-bit scales and minimums,
Q6_K's int8 scales) and random finite positive fp16 super-block scales.
"""
from __future__ import annotations

import numpy as np
import torch

from llmkit.kernels.quant.formats import weight_format


def random_gguf_rows(fmt: str, rows: int, in_features: int, seed: int = 0,
                     scale: float = 0.05) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]`` of GGUF blocks of format ``fmt`` (values around ``scale``)."""
    f = weight_format(fmt)
    rng = np.random.default_rng(seed)
    if fmt in ("q4_0", "q4_1", "q8_0"):
        from gguf import GGMLQuantizationType, quants
        w = (rng.standard_normal((rows, in_features)) * scale).astype(np.float32)
        raw = quants.quantize(w, getattr(GGMLQuantizationType, fmt.upper()))
        return torch.from_numpy(np.ascontiguousarray(raw)).reshape(rows, -1)
    nblk = rows * (in_features // f.block_size)
    blocks = rng.integers(0, 256, size=(nblk, f.block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=nblk) * scale / 32).astype(np.float16)
    if fmt == "q4_k":
        blocks[:, 0:2] = d.view(np.uint8).reshape(nblk, 2)
        dmin = (rng.uniform(0.5, 1.5, size=nblk) * scale / 32).astype(np.float16)
        blocks[:, 2:4] = dmin.view(np.uint8).reshape(nblk, 2)
    elif fmt == "q6_k":
        blocks[:, 208:210] = (d / 8).astype(np.float16).view(np.uint8).reshape(nblk, 2)
    else:
        raise ValueError(f"{fmt} is not a GGUF block format")
    f.row_bytes(in_features)  # checks whole blocks
    return torch.from_numpy(blocks).reshape(rows, -1)
