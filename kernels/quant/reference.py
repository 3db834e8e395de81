"""Torch references for the quantized linears: what each kernel computes, exactly.

Every format is written in an *integer form*: per 32-input block b of output row n,
``w[n, i] = dw[n, b] * qc[n, i] + c[n, b]`` (then times ``row_scale[n]`` for int8/fp8), with
``qc`` the integers the kernel multiplies (Q4_0: ``q - 8``; Q6_K: ``sc * (q - 32)``) and ``dw``,
``c`` the float32 values it takes from the block's scales and minimums; the form's weights are
the GGUF-dequantized ones. Given the activations quantized the kernel's way
(``quantize_activations_ref``: the same bits, ``x_hat = q * d``), every integer kernel computes
``x_hat @ W.T``; ``quant_linear_ref`` evaluates that in float64 and bounds the float32 roundings
the kernel may add to it, so a test can demand the kernel within them -- exact up to the order
of float32 sums, while one wrong integer anywhere is orders of magnitude outside.
``activation_rounding_bound`` bounds how far that is from the product with the unquantized
activations (each input is within d / 2 of its quantized value).
"""
from __future__ import annotations

import dataclasses

import torch

from llmkit.kernels.quant.formats import _half, _nibbles, q4k_scale_min, weight_format

BLOCK = 32
EPS32 = float(torch.finfo(torch.float32).eps)


def padded(in_features: int) -> int:
    return -(-in_features // BLOCK) * BLOCK


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [rows, kp], d float32 [rows, nb], s float64 [rows, nb]) of x [rows, k]: the
    kernel's q and d bit for bit; s exact (the kernel's is its float32 sum)."""
    x = x.to(torch.float32)
    rows, k = x.shape
    kp = padded(k)
    xp = torch.nn.functional.pad(x, (0, kp - k)).reshape(rows, kp // BLOCK, BLOCK)
    amax = xp.abs().amax(dim=-1)
    nonzero = amax != 0
    inv = torch.where(nonzero, torch.tensor(127.0, dtype=torch.float32) / torch.where(nonzero, amax, 1.0),
                      torch.zeros((), dtype=torch.float32))
    q = torch.round(xp * inv.unsqueeze(-1)).to(torch.int8)
    d = amax / torch.tensor(127.0, dtype=torch.float32)
    return q.reshape(rows, kp), d, xp.double().sum(dim=-1)


@dataclasses.dataclass(slots=True)
class IntegerForm:
    """``w[n, b*32 + i] = (dw[n, b] * qc[n, b, i] + c[n, b]) * row_scale[n]`` (float64)."""

    qc: torch.Tensor                 # [n, nb, 32] integers
    dw: torch.Tensor                 # [n, nb]
    c: torch.Tensor | None           # [n, nb] or None (no offset)
    row_scale: torch.Tensor | None   # [n] or None

    def weight(self) -> torch.Tensor:
        """The float64 weight [n, kp] this form stands for."""
        w = self.dw.unsqueeze(-1) * self.qc
        if self.c is not None:
            w = w + self.c.unsqueeze(-1)
        w = w.reshape(w.shape[0], -1)
        return w if self.row_scale is None else w * self.row_scale.unsqueeze(-1)


def integer_form(raw: torch.Tensor, fmt: str, in_features: int,
                 scales: torch.Tensor | None = None) -> IntegerForm:
    """The integer form of GGUF rows ``raw`` (uint8 [n, row_bytes]), or of int8 / fp8 codes
    (uint8 [n, in_features], the int8 or e4m3 bits) with their float32 ``scales`` [n]."""
    f = weight_format(fmt)
    n = raw.shape[0]
    f64, f32 = torch.float64, torch.float32
    if not f.is_gguf:
        kp = padded(in_features)
        codes = torch.nn.functional.pad(raw, (0, kp - in_features))
        if fmt == "int8":
            qc = codes.view(torch.int8).to(f64)
        else:
            qc = codes.view(torch.float8_e4m3fn).to(f64)
        nb = kp // BLOCK
        return IntegerForm(qc.reshape(n, nb, BLOCK), torch.ones(n, nb, dtype=f64), None,
                           scales.to(f64))
    blocks = raw.reshape(-1, f.block_bytes)
    nblk = blocks.shape[0]
    c = None
    if fmt in ("q4_0", "q4_1"):
        off = 2 if fmt == "q4_0" else 4
        dw = _half(blocks[:, 0:2].reshape(nblk, 1, 2)).squeeze(-1)
        qc = _nibbles(blocks[:, off:off + 16]).to(f64)
        if fmt == "q4_0":
            qc = qc - 8
        else:
            c = _half(blocks[:, 2:4].reshape(nblk, 1, 2)).squeeze(-1)
    elif fmt == "q8_0":
        dw = _half(blocks[:, 0:2].reshape(nblk, 1, 2)).squeeze(-1)
        qc = blocks[:, 2:34].contiguous().view(torch.int8).to(f64)
    elif fmt == "q4_k":
        d = _half(blocks[:, 0:2].reshape(nblk, 1, 2))
        dmin = _half(blocks[:, 2:4].reshape(nblk, 1, 2))
        sc, mn = q4k_scale_min(blocks[:, 4:16])
        dw = (d * sc.to(f32)).reshape(-1)
        c = -(dmin * mn.to(f32)).reshape(-1)
        qs = blocks[:, 16:144].reshape(nblk, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
        qc = (qs & 0x0F).reshape(-1, BLOCK).to(f64)
    elif fmt == "q6_k":
        ql = blocks[:, 0:128].reshape(nblk, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(nblk, 8, 32)
        qh = blocks[:, 128:192].reshape(nblk, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(nblk, 8, 32)
        q = (ql | (qh << 4)).to(f64) - 32
        sc = blocks[:, 192:208].contiguous().view(torch.int8).to(f64).reshape(nblk, 8, 2)
        qc = (q.reshape(nblk, 8, 2, 16) * sc.unsqueeze(-1)).reshape(-1, BLOCK)
        d = _half(blocks[:, 208:210].reshape(nblk, 1, 2)).squeeze(-1)
        dw = d.repeat_interleave(8)
    else:  # pragma: no cover
        raise AssertionError(fmt)
    nb = in_features // BLOCK
    return IntegerForm(qc.reshape(n, nb, BLOCK), dw.to(f64).reshape(n, nb),
                       None if c is None else c.to(f64).reshape(n, nb), None)


def quantized_activations(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x_hat = q * d, float64 [rows, nb, 32] (exact: a float32 times a small integer)."""
    q, d, _ = quantize_activations_ref(x)
    return q.to(torch.float64).reshape(x.shape[0], nb, BLOCK) * d.to(torch.float64).unsqueeze(-1)


def _magnitudes(form: IntegerForm, extra: float = 0.0) -> torch.Tensor:
    """|dw * qc| + |c| (+ extra * |dw|) per weight, float64 [n, nb, 32]."""
    mag = (form.dw.abs().unsqueeze(-1) * form.qc.abs())
    if form.c is not None:
        mag = mag + form.c.abs().unsqueeze(-1) + extra * form.dw.abs().unsqueeze(-1)
    return mag


def quant_linear_ref(x: torch.Tensor, form: IntegerForm) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, tol) float64 [rows, n]: ``x_hat @ W.T`` -- what the integer kernels compute for x --
    and a bound on the float32 roundings they may add to it."""
    n, nb, _ = form.qc.shape
    xq = quantized_activations(x, nb).reshape(x.shape[0], -1)
    w = form.dw.unsqueeze(-1) * form.qc
    if form.c is not None:
        w = w + form.c.unsqueeze(-1)
    y = xq @ w.reshape(n, -1).T
    # Per output 2 nb float32 FMAs (half an ulp each, of at most the sum of the magnitudes) and
    # the roundings of d_x * isum and d_x * sum q_x.
    tol = EPS32 * (nb + 4) * (xq.abs() @ _magnitudes(form).reshape(n, -1).T)
    if form.row_scale is not None:
        y = y * form.row_scale
        tol = tol * form.row_scale.abs() + EPS32 * y.abs()
    return y, tol + 1e-30


def float_linear_ref(x: torch.Tensor, form: IntegerForm) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, tol) for the float-activation kernels (fp8; Q4 with ``float_activations``): the
    float64 product with the form's weights, and a bound on a float32 FMA chain over it."""
    rows, k = x.shape
    n, nb, _ = form.qc.shape
    xp = torch.nn.functional.pad(x.double(), (0, nb * BLOCK - k))
    w = (form.dw.unsqueeze(-1) * form.qc)
    y = xp @ (w if form.c is None else w + form.c.unsqueeze(-1)).reshape(n, -1).T
    # The Q4 kernels sum (q - 8) * x and add (c + 8 dw) * sum x: magnitudes up to 16 |dw| more.
    mag = xp.abs() @ _magnitudes(form, extra=16.0).reshape(n, -1).T
    # One float32 FMA chain per output over at most every input (fp8) plus a product per block.
    tol = EPS32 * (nb * BLOCK // 2 + nb + 8) * mag
    if form.row_scale is not None:
        y = y * form.row_scale
        tol = tol * form.row_scale.abs() + EPS32 * y.abs()
    return y, tol + 1e-30


def activation_rounding_bound(x: torch.Tensor, form: IntegerForm) -> torch.Tensor:
    """float64 [rows, n]: how far the integer kernels' ``x_hat @ W.T`` may be from ``x @ W.T``
    -- each quantized input is within d / 2 of its input."""
    _, d, _ = quantize_activations_ref(x)
    n, nb, _ = form.qc.shape
    w = (form.dw.unsqueeze(-1) * form.qc)
    if form.c is not None:
        w = w + form.c.unsqueeze(-1)
    bound = torch.einsum("mb,nbi->mn", d.double() * 0.50001, w.abs())
    return bound if form.row_scale is None else bound * form.row_scale.abs()
