"""The quantized-weight CPU kernels (``llmkit.kernels.quant``, ``kernels/cpu/quant_*.h``)
against torch references:

- the torch dequantize of every kept GGUF format equals gguf-py's ``dequantize`` bit for bit,
  and so does reading the repacked weight back (the repack moves bits only);
- the activations are quantized to the reference's bits (both code paths);
- every format's kernel is within float32 rounding of the exact integer-form reference given
  the same activation quantization (``quant_linear_ref``), and within the activations'
  rounding of dequantize-then-matmul, for 1-9, 64 and 512 rows and odd shapes;
- the vectorised code of every instruction-set tier and the portable code give the same bits.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from llmkit.config.cpu_isa import supported_tiers
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.quant import formats, reference, weights

from helpers import gguf_rows

GGUF = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
# (in_features, out_features): several blocks, out not a multiple of the 8-row group.
SHAPES = {"q4_0": (96, 20), "q4_1": (96, 20), "q8_0": (96, 20), "q4_k": (512, 20),
          "q6_k": (512, 20), "int8": (77, 19), "fp8": (77, 19)}
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 512)


@pytest.fixture(scope="module")
def ops():
    return load_cpu_kernels()


TIERS = supported_tiers()


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def make_weight(fmt: str, k: int, n: int, seed: int = 0):
    """(PackedWeight, IntegerForm, float32 dequantized weight) of a random weight."""
    if fmt in GGUF:
        raw = gguf_rows.random_gguf_rows(fmt, n, k, seed=seed)
        return (weights.pack_gguf(raw, fmt, k), reference.integer_form(raw, fmt, k),
                formats.dequantize_gguf(raw, fmt, k))
    codes, scales = (weights.int8_codes if fmt == "int8" else weights.fp8_codes)(
        randn(n, k, seed=seed, scale=0.05))
    dense = codes.to(torch.float32) * scales[:, None]
    return (weights.pack_codes(codes, scales, fmt),
            reference.integer_form(codes.view(torch.uint8), fmt, k, scales), dense)


# -- formats and repacking -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", GGUF)
def test_dequantize_and_repack_equal_gguf(fmt):
    from gguf import GGMLQuantizationType, quants
    k = 512 if fmt in ("q4_k", "q6_k") else 160
    raw = gguf_rows.random_gguf_rows(fmt, 13, k, seed=3)
    expected = torch.from_numpy(quants.dequantize(raw.numpy(), getattr(GGMLQuantizationType, fmt.upper())))
    expected = expected.reshape(13, k)
    assert torch.equal(formats.dequantize_gguf(raw, fmt, k), expected)
    packed = weights.pack_gguf(raw, fmt, k)
    assert torch.equal(weights.dequantize(packed), expected)
    rows = torch.tensor([12, 0, 7, 7, 8])
    assert torch.equal(weights.dequantize(packed, rows), expected[rows])
    assert torch.equal(reference.integer_form(raw, fmt, k).weight().float(), expected)


@pytest.mark.parametrize("fmt", ("int8", "fp8"))
def test_int8_and_fp8_store_codes_times_scales(fmt):
    w = randn(11, 45, seed=1)
    codes, scales = (weights.int8_codes if fmt == "int8" else weights.fp8_codes)(w)
    dense = codes.to(torch.float32) * scales[:, None]
    # per output channel: the row's largest magnitude maps to the format's largest code
    assert torch.allclose(dense.abs().amax(1), w.abs().amax(1), rtol=1e-6)
    packed = weights.pack_codes(codes, scales, fmt)
    assert torch.equal(weights.dequantize(packed), dense)
    step = 1 / 127 if fmt == "int8" else 2 ** -4  # e4m3: 3 mantissa bits
    assert ((dense - w).abs() <= step * w.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("portable", (False, True))
def test_activation_quantization_matches_the_reference(ops, portable):
    x = randn(7, 200, seed=2, scale=3)
    x[1, 32:64] = 0  # an all-zero block
    x[2, 5] = 1e4  # one outlier
    q, d, s = ops.quantize_activations_q8(x, portable)
    qr, dr, sr = reference.quantize_activations_ref(x)
    assert torch.equal(q, qr) and torch.equal(d, dr)
    assert torch.allclose(s.double(), sr, rtol=0, atol=1e-5 * float(x.abs().max()))
    assert int(q.abs().max()) <= 127


# -- the linear ------------------------------------------------------------------------------
def check_linear(fmt: str, k: int, n: int, rows: int, seed: int = 0, **kw):
    packed, form, dense = make_weight(fmt, k, n, seed)
    x = randn(rows, k, seed=seed + 100)
    y = weights.quant_linear(x, packed, **kw).double()
    float_path = fmt == "fp8" or kw.get("float_activations")
    ref, tol = (reference.float_linear_ref if float_path else reference.quant_linear_ref)(x, form)
    assert ((y - ref).abs() <= tol).all(), f"{fmt} rows={rows}: {((y - ref).abs() / tol).max():.3g} x tol"
    exact = x.double() @ dense.double().T
    bound = tol if float_path else tol + reference.activation_rounding_bound(x, form)
    assert ((y - exact).abs() <= bound).all()
    return x, packed, y


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_linear_matches_the_integer_reference(fmt, rows):
    k, n = SHAPES[fmt]
    x, packed, y = check_linear(fmt, k, n, rows)
    if rows in (1, 5, 64):
        assert torch.equal(weights.quant_linear(x, packed, portable=True).double(), y)


@pytest.mark.parametrize("tier", TIERS)
def test_every_tier_computes_the_portable_bits(tier):
    """Each instruction-set tier's kernel (AVX2's maddubs + madd, VNNI's vpdpbusd, ...) gives
    the portable scalar code's bits, for every format, at decode and prefill row counts: the
    tiers differ in speed only (the portable code is checked against the integer reference
    above)."""
    tier_ops = load_cpu_kernels(tier)
    for fmt in SHAPES:
        k, n = (576, 40) if fmt not in ("q4_k", "q6_k") else (512, 40)
        packed, _, _ = make_weight(fmt, k, n, seed=7)
        for rows in (1, 3, 6, 8, 17, 64):  # 6: a verify step of 5 drafts
            x = randn(rows, k, seed=rows)
            fast = tier_ops.quant_linear(x, packed.data, packed.format, n, packed.scales)
            portable = tier_ops.quant_linear(x, packed.data, packed.format, n, packed.scales,
                                             None, False, True)
            assert torch.equal(fast, portable), (tier, fmt, rows)


@pytest.mark.parametrize("tier", TIERS)
def test_a_row_gets_the_same_bits_in_any_batch(tier):
    """A row's outputs do not depend on the rows beside it: alone (the VNNI/AVX2 GEMV), in 17
    rows (the amx tier: a full tile and a zero-padded one) and in 64, with a bias, in float32
    and bf16."""
    tier_ops = load_cpu_kernels(tier)
    for fmt, dtype in itertools.product(SHAPES, (torch.float32, torch.bfloat16)):
        k, n = (576, 40) if fmt not in ("q4_k", "q6_k") else (512, 40)
        packed, _, _ = make_weight(fmt, k, n, seed=3)
        x = randn(64, k, seed=11).to(dtype)
        bias = randn(n, seed=12).to(dtype)
        full = tier_ops.quant_linear(x, packed.data, packed.format, n, packed.scales, bias)
        for rows in (slice(0, 1), slice(0, 17), slice(40, 41), slice(30, 47)):
            part = tier_ops.quant_linear(x[rows].contiguous(), packed.data, packed.format, n,
                                         packed.scales, bias)
            assert torch.equal(part, full[rows]), (tier, fmt, dtype, rows)


@pytest.mark.parametrize("fmt", ("q4_0", "q4_1"))
@pytest.mark.parametrize("rows", (1, 3, 8, 64))
def test_float_activations(fmt, rows):
    x, packed, y = check_linear(fmt, 96, 20, rows, float_activations=True)
    assert torch.equal(weights.quant_linear(x, packed, float_activations=True, portable=True).double(), y)


@pytest.mark.parametrize("fmt,k,n", [("q4_1", 576, 200), ("q8_0", 1536, 64), ("q4_k", 1536, 40),
                                     ("q6_k", 256, 48), ("int8", 1, 9), ("int8", 33, 8),
                                     ("fp8", 31, 17)])
def test_linear_odd_and_model_shapes(fmt, k, n):
    check_linear(fmt, k, n, 3, seed=5)


def test_float_activations_are_more_exact_than_q8():
    """Against the exact product with the same weights, keeping the activations in float32
    removes the 8-bit activation error (the integer path's error is bounded, not zero)."""
    packed, form, dense = make_weight("q4_1", 576, 64, seed=9)
    x = randn(4, 576, seed=10)
    exact = x.double() @ dense.double().T
    e_int = (weights.quant_linear(x, packed).double() - exact).abs().max()
    e_float = (weights.quant_linear(x, packed, float_activations=True).double() - exact).abs().max()
    assert e_float * 100 < e_int


def test_bias_bf16_leading_dims_and_empty(ops):
    packed, form, dense = make_weight("q4_1", 64, 24)
    bias = randn(24, seed=3)
    x = randn(2, 3, 64, seed=4)
    y = weights.quant_linear(x, packed, bias)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, weights.quant_linear(x, packed) + bias, rtol=0, atol=1e-6)
    xb, bb = x.bfloat16(), bias.bfloat16()
    yb = weights.quant_linear(xb, packed, bb)
    assert yb.dtype == torch.bfloat16
    ref = (weights.quant_linear(xb.float(), packed) + bb.float()).bfloat16()
    assert (yb.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    assert weights.quant_linear(torch.zeros(0, 64), packed).shape == (0, 24)


@pytest.mark.parametrize("fmt", ("q4_1", "int8"))
def test_concat_rows_is_one_linear_over_the_parts(fmt):
    parts = [make_weight(fmt, 64, n, seed=i) for i, n in enumerate((16, 8, 13))]
    merged = weights.concat_rows([p for p, _, _ in parts])
    x = randn(3, 64, seed=7)
    assert torch.equal(weights.quant_linear(x, merged),
                       torch.cat([weights.quant_linear(x, p) for p, _, _ in parts], dim=1))
    assert torch.equal(weights.dequantize(merged), torch.cat([d for _, _, d in parts]))
    with pytest.raises(ValueError, match="multiple of 8"):
        weights.concat_rows([parts[2][0], parts[0][0]])


def test_bad_inputs_are_clear_errors(ops):
    packed, _, _ = make_weight("q4_1", 64, 24)
    with pytest.raises(ValueError, match="features"):
        weights.quant_linear(torch.zeros(1, 32), packed)
    with pytest.raises(RuntimeError, match="unknown weight format 'q5_0'"):
        ops.quant_linear(torch.zeros(1, 64), packed.data, "q5_0", 24)
    with pytest.raises(RuntimeError, match="bytes"):
        ops.quant_linear(torch.zeros(1, 64), packed.data[:-1].contiguous(), "q4_1", 24)
    with pytest.raises(RuntimeError, match="whole blocks"):
        ops.quant_repack(torch.zeros(2, 20, dtype=torch.uint8), "q4_1", 48)
    with pytest.raises(RuntimeError, match="float_activations"):
        ops.quant_linear(torch.zeros(1, 96), make_weight("q8_0", 96, 8)[0].data, "q8_0", 8,
                         None, None, True)
    with pytest.raises(RuntimeError, match="scales"):
        ops.quant_linear(torch.zeros(1, 77), make_weight("int8", 77, 19)[0].data, "int8", 19)
    with pytest.raises(ValueError, match="whole blocks"):
        formats.weight_format("q4_k").row_bytes(300)
