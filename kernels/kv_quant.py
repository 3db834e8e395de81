"""The quantized KV cache format (``kv_cache.cache_dtype=int8|fp8_e4m3``) and its torch
reference: what every KV writer stores and every reader dequantizes, bit for bit.

A quantized layer cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim + 4]`` of one
byte per element: each *row* (one token's K or V of one KV head) is ``head_dim`` codes followed
by the row's float32 scale in 4 bytes (native byte order). ``int8`` codes are ``torch.int8``;
``fp8_e4m3`` codes are e4m3fn bytes (OCP/NVIDIA's e4m3, max 448) held in a ``torch.uint8``
tensor, so that every copy, gather and byte view the pool sees works on any torch build (float8
tensors lack many CPU ops). The storage dtype therefore says the format: ``int8`` = int8 codes,
``uint8`` = e4m3 codes.

Why one scale per row (per token, KV head and K/V; ``head_dim`` values, llama.cpp's q8_0 uses 32):
KV is written append-only, a token at a time, so a row's range is known when it is written and
no row is ever re-quantized -- a per-(block, head) scale would have to grow as later tokens of
the block arrive, re-quantizing the earlier ones (or guess the range up front, as vLLM's static
per-tensor ``k_scale`` does). Keeping the scale *inside* the row makes a block self-contained:
wherever a block's bytes go -- prefix-cache reuse (same block id), KV connectors, the offload
tiers, the disk -- its scales go with it, with no second tensor to keep in step. Cost: 4 bytes
per ``head_dim`` codes (6% at head_dim 64), so an int8/fp8 block is ``(D + 4) / (2 D)`` of a
bf16 block (0.53 at D = 64) and ``(D + 4) / (4 D)`` of a float32 one.

The numerics, identical in the torch reference, the C++ kernels and the Triton kernels::

    amax  = max |x|  over the row (x in float32)
    scale = amax / QMAX                       (float32; QMAX = 127 for int8, 448 for e4m3)
    y     = clamp(x / (scale if scale > 0 else 1), -QMAX, QMAX)
    code  = round-half-even(y) as int8        | e4m3fn(y), round-to-nearest-even
    value = float(code) * scale               (one float32 multiply)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one float32 scale at the end of every row


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    name: str  # the kv_cache.cache_dtype value
    storage_dtype: torch.dtype  # the pool tensor's dtype
    qmax: float  # the largest code magnitude


INT8 = KVQuantFormat("int8", torch.int8, 127.0)
FP8_E4M3 = KVQuantFormat("fp8_e4m3", torch.uint8, 448.0)
FORMATS = {f.name: f for f in (INT8, FP8_E4M3)}
_BY_STORAGE = {f.storage_dtype: f for f in (INT8, FP8_E4M3)}


def format_of(cache_or_dtype: torch.Tensor | torch.dtype) -> KVQuantFormat | None:
    """The quantized format a cache tensor (or its dtype) holds; ``None`` for a float cache."""
    dtype = cache_or_dtype.dtype if isinstance(cache_or_dtype, torch.Tensor) else cache_or_dtype
    return _BY_STORAGE.get(dtype)


def cache_row_width(head_dim: int, storage_dtype: torch.dtype) -> int:
    """Elements of one cache row: ``head_dim``, plus the scale's bytes in a quantized cache."""
    return head_dim + SCALE_BYTES if format_of(storage_dtype) is not None else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The model's head_dim behind a cache tensor of rows in its last dimension."""
    return kv_cache.shape[-1] - (SCALE_BYTES if format_of(kv_cache) is not None else 0)


def quantize_rows(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) -> rows ``[..., D + 4]`` of ``fmt.storage_dtype``."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / fmt.qmax
    y = (xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-fmt.qmax, fmt.qmax)
    if fmt is INT8:
        codes = torch.round(y).to(torch.int8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(fmt.storage_dtype)  # [..., 4] bytes of the float32
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D + 4]`` of a quantized cache -> float32 ``[..., D]``."""
    fmt = format_of(rows)
    assert fmt is not None, f"not a quantized KV cache ({rows.dtype})"
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    codes = rows[..., :d]
    if fmt is FP8_E4M3:
        codes = codes.contiguous().view(torch.float8_e4m3fn)
    return codes.float() * scale


def read_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an attention read sees of cache rows: dequantized (then cast) for a quantized
    cache, cast for a float cache."""
    if format_of(rows) is not None:
        return dequantize_rows(rows).to(dtype)
    return rows.to(dtype)


def to_cache_rows(x: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """What a KV write stores for ``x [..., D]`` in a cache of ``storage_dtype``."""
    fmt = format_of(storage_dtype)
    return quantize_rows(x, fmt) if fmt is not None else x.to(storage_dtype)


def fake_quantize(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """``x`` through the cache and back (``dequantize(quantize(x))``), in ``x``'s dtype: what a
    reader of a quantized cache sees of ``x``."""
    return dequantize_rows(quantize_rows(x, fmt)).to(x.dtype)


def quant_args(kv_cache: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A Triton attention kernel's ``QUANT`` (0 float, 1 int8, 2 e4m3) and its ``scale_ptr``
    (the cache seen as float32, where each row's scale is one element; the cache itself when
    there are no scales)."""
    fmt = format_of(kv_cache)
    if fmt is None:
        return 0, kv_cache
    assert kv_cache.is_contiguous() and head_dim_of(kv_cache) % 4 == 0
    return (1 if fmt is INT8 else 2), kv_cache.view(torch.float32)
