"""Packed quantized weights and the linears over them (``torch.ops.llmkit_cpu_<tier>.quant_*``).

A ``PackedWeight`` is an ``[out_features, in_features]`` weight in one of the kernels' packed
layouts (``kernels/cpu/quant_blocks.h``): GGUF blocks repacked eight rows at a time
(``pack_gguf``), or a float weight quantized per output channel to int8 (``quantize_int8``) or
stored as fp8 e4m3 (``quantize_fp8``). ``quant_linear`` multiplies activations with it for any
number of rows, ``dequantize`` reads rows of it back as float32 (an embedding's lookup), and
``concat_rows`` stacks weights of one input into one (merged projections).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from llmkit.kernels.quant.formats import weight_format

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclasses.dataclass(frozen=True, slots=True)
class PackedWeight:
    format: str                       # q4_0 q4_1 q8_0 q4_k q6_k int8 fp8
    out_features: int
    in_features: int
    data: torch.Tensor                # uint8, the packed layout
    scales: torch.Tensor | None = None  # float32 [out_features] (int8, fp8)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.scales is None else self.scales.numel() * 4)


def _ops():
    from llmkit.kernels.cpu_native import any_loaded_cpu_kernels
    return any_loaded_cpu_kernels()  # layout ops: the same bits in every tier


def pack_gguf(raw: torch.Tensor | np.ndarray, fmt: str, in_features: int) -> PackedWeight:
    """GGUF rows ``raw`` (uint8 ``[out_features, row_bytes]``) of format ``fmt`` packed."""
    f = weight_format(fmt)
    if not f.is_gguf:
        raise ValueError(f"{fmt} is not a GGUF block format")
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw))
    raw = raw.reshape(raw.shape[0], -1).contiguous()
    data = _ops().quant_repack(raw, fmt, in_features)
    return PackedWeight(fmt, raw.shape[0], in_features, data)


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel int8: (codes int8 [out, in], scales float32 [out]) with
    ``weight ~= codes * scales[:, None]``, scale = max |w| / 127 of the row."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return codes, scales


def fp8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 per output channel: (codes float8_e4m3fn [out, in], scales float32 [out]) with
    ``weight ~= codes * scales[:, None]``, the row's max |w| mapped to 448."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> PackedWeight:
    """int8 or fp8 codes ``[out, in]`` with float32 ``scales`` [out] packed."""
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"pack_codes packs int8 or fp8, not {fmt}")
    raw = codes.contiguous().view(torch.uint8)
    data = _ops().quant_repack(raw, fmt, codes.shape[1])
    return PackedWeight(fmt, codes.shape[0], codes.shape[1], data,
                        scales.to(torch.float32).contiguous())


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    return pack_codes(*int8_codes(weight), "int8")


def quantize_fp8(weight: torch.Tensor) -> PackedWeight:
    return pack_codes(*fp8_codes(weight), "fp8")


def quant_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
                 float_activations: bool = False, portable: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` for x ``[..., in_features]`` (float32 or bfloat16), in x's dtype.

    ``float_activations`` (q4_0, q4_1) keeps the activations in float32 instead of quantizing
    them to 8 bits per block; ``portable`` runs the scalar code instead of AVX2 (same bits).
    """
    if x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] == weight.in_features:
        return _ops().quant_linear(x, weight.data, weight.format, weight.out_features,
                                   weight.scales, bias, float_activations, portable)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _ops().quant_linear(x2, weight.data, weight.format, weight.out_features, weight.scales,
                            bias, float_activations, portable)
    return y.reshape(*lead, weight.out_features)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """One weight whose rows are ``parts``' rows in order (a merged q|k|v or gate|up linear):
    the packed groups of eight rows concatenate as they are, so every part but the last needs
    a multiple of 8 rows."""
    first = parts[0]
    for p in parts:
        if (p.format, p.in_features) != (first.format, first.in_features):
            raise ValueError(f"concat_rows: {p.format} [{p.out_features}, {p.in_features}] "
                             f"does not stack under {first.format} [.., {first.in_features}]")
    for p in parts[:-1]:
        if p.out_features % 8:
            raise ValueError(f"concat_rows: a part of {p.out_features} rows (not a multiple of "
                             "8) can only come last")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])
    return PackedWeight(first.format, sum(p.out_features for p in parts), first.in_features,
                        torch.cat([p.data for p in parts]), scales)


def dequantize(weight: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of rows ``rows`` (int64; all rows when None) of the weight."""
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64)
    return _ops().quant_dequantize(weight.data, weight.format, weight.out_features,
                                   weight.in_features, weight.scales, rows)
