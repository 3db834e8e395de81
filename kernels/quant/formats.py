"""The weight formats llmkit keeps quantized, and the torch reference dequantize of GGUF blocks.

``dequantize_gguf(raw, fmt, in_features)`` turns a GGUF tensor's raw rows (uint8
``[rows, row_bytes]``, as ``gguf.GGUFReader`` gives them) into float32 with the same operations
and roundings as ``gguf.quants.dequantize`` (each value is one float32 rounding of its exact
value), so the two agree bit for bit; the tests check that on every format.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(frozen=True, slots=True)
class WeightFormat:
    """One packed weight format of ``torch.ops.llmkit_cpu.quant_*``."""

    name: str             # the kernels' name for it
    block_size: int       # inputs per block (rows are whole blocks for the GGUF formats)
    block_bytes: int      # bytes of one GGUF block of one row (0: one byte per weight)
    row_scales: bool      # a float32 scale per output row (int8, fp8)

    @property
    def is_gguf(self) -> bool:
        return self.block_bytes > 0

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row in its source form (GGUF blocks, or one byte per weight)."""
        if not self.is_gguf:
            return in_features
        if in_features % self.block_size:
            raise ValueError(f"{self.name} rows are whole blocks of {self.block_size} inputs, "
                             f"got {in_features}")
        return in_features // self.block_size * self.block_bytes


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("q4_0", 32, 18, False),
    WeightFormat("q4_1", 32, 20, False),
    WeightFormat("q8_0", 32, 34, False),
    WeightFormat("q4_k", 256, 144, False),
    WeightFormat("q6_k", 256, 210, False),
    WeightFormat("int8", 32, 0, True),
    WeightFormat("fp8", 32, 0, True),
)}

#: GGUF tensor types (``gguf.GGMLQuantizationType`` names) kept quantized, by kernel format.
GGUF_KEPT = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def weight_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})") from None


def _half(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes (last dim 2) as float16 -> float32."""
    return b.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def q4k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes per block -> (8 scales, 8 minimums), 6 bits each."""
    s = scales.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_gguf(raw: torch.Tensor | np.ndarray, fmt: str, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of GGUF blocks ``raw`` (uint8 ``[rows, row_bytes]``)."""
    f = weight_format(fmt)
    if not f.is_gguf:
        raise ValueError(f"{fmt} is not a GGUF block format")
    raw = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    rows = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.shape[1] != f.row_bytes(in_features):
        raise ValueError(f"{fmt}: expected uint8 [rows, {f.row_bytes(in_features)}], got "
                         f"{raw.dtype} {list(raw.shape)}")
    blocks = raw.reshape(-1, f.block_bytes)
    n = blocks.shape[0]
    if fmt == "q4_0":
        d = _half(blocks[:, 0:2].reshape(n, 1, 2))
        q = _nibbles(blocks[:, 2:18]).to(torch.int32) - 8
        out = d * q.to(torch.float32)
    elif fmt == "q4_1":
        d = _half(blocks[:, 0:2].reshape(n, 1, 2))
        m = _half(blocks[:, 2:4].reshape(n, 1, 2))
        out = d * _nibbles(blocks[:, 4:20]).to(torch.float32) + m
    elif fmt == "q8_0":
        d = _half(blocks[:, 0:2].reshape(n, 1, 2))
        out = blocks[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * d
    elif fmt == "q4_k":
        d = _half(blocks[:, 0:2].reshape(n, 1, 2))
        dmin = _half(blocks[:, 2:4].reshape(n, 1, 2))
        sc, mn = q4k_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, 8, 32).to(torch.float32)
        dsub = (d * sc.to(torch.float32)).reshape(n, 8, 1)
        dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
        out = (dsub * q - dm).reshape(n, 256)
    elif fmt == "q6_k":
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 8, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(n, 8, 32)
        q = (ql | (qh << 4)).to(torch.int32) - 32
        scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        d = _half(blocks[:, 208:210].reshape(n, 1, 2))
        dsc = (d * scales).reshape(n, 16, 1)
        out = (dsc * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)
    else:  # pragma: no cover - FORMATS and this chain list the same names
        raise AssertionError(fmt)
    return out.reshape(rows, in_features)
