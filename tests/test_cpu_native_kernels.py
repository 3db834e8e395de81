"""llmkit's C++ CPU kernels (``llmkit.kernels.cpu_native``) against the torch op sequences they
replace: bit for bit in bfloat16 where the kernel only fuses element-wise ops (it must round
where Hugging Face's ops round), to float32 accuracy where it reorders a sum (attention, the
one-row linear). Then the platform switch that hands them to the engine."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.config.cpu_isa import supported_tiers
from llmkit.config.schema import PlatformConfig
from llmkit.kernels import cpu_native
from llmkit.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels
from llmkit.ops.base import paged_decode_attention_reference
from llmkit.platforms import CpuPlatform, CudaPlatform

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", params=supported_tiers())
def ops(request):
    """Every kernel test runs against each instruction-set tier this CPU supports (the lower
    ones forced), so that AVX2's code stays tested on an AVX-512 machine."""
    return load_cpu_kernels(request.param)


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def assert_norm_matches(out, ref):
    # Bit for bit in both dtypes: the sum of squares runs in torch's own cascade order.
    assert out.dtype == ref.dtype and torch.equal(out, ref)


# -- element-wise fusions --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 37, 5, 70000])  # vectors, a tail, < 1 vector, > 16^4/4 vectors
def test_rms_norm(ops, dtype, hidden):
    x, w = randn(9, hidden, dtype=dtype, scale=3), randn(hidden, dtype=dtype, seed=1)
    assert_norm_matches(ops.rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5))
    # rows of a wider tensor (strided rows) read in place
    wide = randn(9, hidden + 8, dtype=dtype, seed=2)
    assert_norm_matches(ops.rms_norm(wide[:, :hidden], w, 1e-6),
                        hf_rms_norm(wide[:, :hidden], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_the_residual_in_place(ops, dtype):
    x, w = randn(5, 200, dtype=dtype), randn(200, dtype=dtype, seed=1)
    residual = randn(5, 200, dtype=dtype, seed=2)
    expected_residual = residual + x  # one bf16 rounding, like the model's residual stream
    out = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, expected_residual)
    assert_norm_matches(out, hf_rms_norm(expected_residual, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 19])
def test_silu_and_mul(ops, dtype, d):
    x = randn(4, 2 * d, dtype=dtype, scale=4)
    ref = F.silu(x[:, :d]) * x[:, d:]
    out = ops.silu_and_mul(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:  # torch's float32 silu and ours may differ in the last bit of exp
        torch.testing.assert_close(out, ref, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_fused_qkv_output(ops, dtype):
    """HF's ``q * cos + rotate_half(q) * sin`` in the model's dtype, bit for bit, written into
    the Q and K heads of a fused QKV row while V stays untouched."""
    tokens, heads, kv_heads, d = 7, 9, 3, 64
    qkv = randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype)
    cos_sin = randn(tokens, d, dtype=dtype, seed=1)
    qk = qkv[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    cos = cos_sin[:, None, :d // 2].repeat(1, 1, 2)
    sin = cos_sin[:, None, d // 2:].repeat(1, 1, 2)
    expected = qk * cos + torch.cat([-qk[..., d // 2:], qk[..., :d // 2]], -1) * sin
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    ops.rotary_embedding_(qk, cos_sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)


def test_element_wise_rows_do_not_depend_on_their_batch(ops):
    """The row ops split a batch over the threads only where each thread gets enough rows
    (kernels/cpu/row_split.h): a 64-row decode batch runs on the calling thread, 2,048 prompt
    rows over the threads. Either way each row's bits are its own, as when it runs alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_rows_alone_and_in_a_batch(ops)
    finally:
        torch.set_num_threads(threads)


def _check_rows_alone_and_in_a_batch(ops):
    rows, hidden, d = 600, 576, 1536  # several tasks of each op at 2 threads
    x, w = randn(rows, hidden, dtype=torch.bfloat16, scale=3), randn(hidden, dtype=torch.bfloat16, seed=1)
    res = randn(rows, hidden, dtype=torch.bfloat16, seed=2)
    gu = randn(rows, 2 * d, dtype=torch.bfloat16, scale=4, seed=3)
    qk = randn(rows, 12, 64, dtype=torch.bfloat16, seed=4)
    cos_sin = randn(rows, 64, dtype=torch.bfloat16, seed=5)
    res_all = res.clone()
    normed = ops.fused_add_rms_norm(x, res_all, w, 1e-5)
    act = ops.silu_and_mul(gu)
    rot = qk.clone()
    ops.rotary_embedding_(rot, cos_sin)
    for i in range(rows):  # every row: the tasks start where the split puts them
        r = res[i:i + 1].clone()
        assert torch.equal(ops.fused_add_rms_norm(x[i:i + 1], r, w, 1e-5), normed[i:i + 1])
        assert torch.equal(r, res_all[i:i + 1])
        assert torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-5), ops.rms_norm(x, w, 1e-5)[i:i + 1])
        assert torch.equal(ops.silu_and_mul(gu[i:i + 1]), act[i:i + 1])
        one = qk[i:i + 1].clone()
        ops.rotary_embedding_(one, cos_sin[i:i + 1])
        assert torch.equal(one, rot[i:i + 1])


# -- the paged cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(ops, slot_dtype):
    blocks, block_size, kv_heads, d = 6, 4, 3, 8
    cache = torch.zeros(2, blocks, block_size, kv_heads, d, dtype=torch.bfloat16)
    # k and v as strided views into a fused QKV output, as the model hands them over
    qkv = randn(5, 5 * kv_heads * d, dtype=torch.bfloat16)
    k = qkv[:, 3 * kv_heads * d:4 * kv_heads * d].view(5, kv_heads, d)
    v = qkv[:, 4 * kv_heads * d:].view(5, kv_heads, d)
    slots = torch.tensor([17, 3, -1, 0, 23], dtype=slot_dtype)
    ops.reshape_and_cache(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    keep = slots >= 0
    expected[0].view(-1, kv_heads, d)[slots[keep].long()] = k[keep]
    expected[1].view(-1, kv_heads, d)[slots[keep].long()] = v[keep]
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.reshape_and_cache(k, v, cache, torch.tensor([0, 1, 2, 3, 24], dtype=slot_dtype))


def sdpa_reference(q, cache, table, lens, scale, dtype=torch.float32):
    """Gather each row's context through its block table, then SDPA in ``dtype``."""
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // kv_heads
    out = []
    for b in range(q.shape[0]):
        slots = (table[b].long()[:, None] * block_size + torch.arange(block_size)).flatten()
        slots = slots[:int(lens[b])]
        kc = cache[0].flatten(0, 1)[slots].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
        vc = cache[1].flatten(0, 1)[slots].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].to(dtype)[None, :, None], kc[None],
                                                  vc[None], scale=scale)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_paged_decode_attention(ops, dtype, table_dtype, heads, kv_heads):
    blocks, block_size, d = 24, 16, 64
    lens = torch.tensor([1, 16, 17, 100, 250])  # one token, a full block, a block + 1, ...
    g = torch.Generator().manual_seed(3)
    table = torch.stack([torch.randperm(blocks, generator=g)[:16] for _ in lens])
    table = table.to(table_dtype)
    cache = randn(2, blocks, block_size, kv_heads, d, dtype=dtype, seed=4)
    q = randn(len(lens), heads, d, dtype=dtype, seed=5)
    out = ops.paged_decode_attention(q, cache, table, lens, d ** -0.5)
    ref = sdpa_reference(q, cache, table, lens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        # bf16 follows torch's own bf16 SDPA (what HF's bf16 model runs), probabilities rounded
        # to bf16 included: most outputs bit-equal to it, the rest a bf16 step or two apart.
        sdpa = sdpa_reference(q, cache, table, lens, d ** -0.5, dtype)
        torch.testing.assert_close(out, sdpa, rtol=2 ** -6, atol=2 ** -9)
        assert (out == sdpa).float().mean() >= 0.75


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64])
def test_paged_decode_attention_one_sequence_gives_its_bits_in_a_batch(ops, dtype, lens_dtype):
    """One sequence splits its work per query head (3 KV heads would leave a thread idle) or,
    where a KV head's group runs at once (AVX-512 bf16), keeps its groups whole, on the calling
    thread while its context is short; a batch splits per KV head. Same math per head, so the
    same bits."""
    lens = torch.tensor([300, 37, 90, 5], dtype=lens_dtype)
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))
                         for i in range(4)])
    cache = randn(2, 24, 16, 3, 64, dtype=dtype, seed=8)
    q = randn(4, 9, 64, dtype=dtype, seed=9)
    batched = ops.paged_decode_attention(q, cache, table, lens, 0.125)
    for b in range(4):
        alone = ops.paged_decode_attention(q[b:b + 1], cache, table[b:b + 1], lens[b:b + 1],
                                           0.125)
        assert torch.equal(alone, batched[b:b + 1])
    torch.testing.assert_close(batched.float(), sdpa_reference(q, cache, table, lens, 0.125),
                               rtol=2 ** -6, atol=2 ** -9)


def test_paged_decode_attention_bf16_past_one_sdpa_block(ops):
    """Contexts longer than SDPA's 512-row blocks: the running max and sum are rescaled."""
    lens = torch.tensor([513, 700, 1024])
    table = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i))
                         for i in range(3)])
    cache = randn(2, 64, 16, 3, 64, dtype=torch.bfloat16, seed=6)
    q = randn(3, 9, 64, dtype=torch.bfloat16, seed=7)
    out = ops.paged_decode_attention(q, cache, table, lens, 0.125)
    sdpa = sdpa_reference(q, cache, table, lens, 0.125, torch.bfloat16)
    torch.testing.assert_close(out, sdpa, rtol=2 ** -6, atol=2 ** -9)
    assert (out == sdpa).float().mean() >= 0.75


AVX512_TIERS = ("avx512", "avx512_vnni", "avx512_bf16", "amx")


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 4, 4), (64, 8, 1), (80, 4, 2)])
def test_paged_decode_attention_bf16_on_every_tier(ops, dim, heads, kv_heads):
    """bf16 decode attention at every length (a tail past the tiles of 16 rows and the pairs
    of rows, empty, past one 512-row SDPA block), with a window and with a soft cap. The AVX2
    tiers run torch's flash-SDPA order: the AVX2 tier's bits. The AVX-512 tiers run bf16 dot
    products of their own (head sizes that are multiples of 32; others the AVX2 bits): each
    output within bf16 accuracy of the float32 reference (the P rounded to bf16 as SDPA's),
    most bit-equal to torch's bf16 SDPA, the same bits on all four AVX-512 tiers (the tiers
    without AVX512-BF16 emulate its products exactly on these inputs), and one sequence's
    bits alone equal to its bits in the batch."""
    avx2 = load_cpu_kernels("avx2")
    lens = torch.tensor([1, 7, 8, 9, 17, 100, 250, 0, 513, 1030])
    table = torch.stack([torch.randperm(70, generator=torch.Generator().manual_seed(i))
                         for i in range(len(lens))])
    cache = randn(2, 70, 16, kv_heads, dim, dtype=torch.bfloat16, seed=dim)
    q = randn(len(lens), heads, dim, dtype=torch.bfloat16, seed=1)
    own_bits = ops.name.endswith(AVX512_TIERS) and dim % 32 == 0
    first = load_cpu_kernels(AVX512_TIERS[0]) if own_bits else avx2
    for window, cap in ((0, 0.0), (37, 0.0), (0, 30.0)):
        out = ops.paged_decode_attention(q, cache, table, lens, 0.125, window, cap)
        assert torch.equal(out, first.paged_decode_attention(q, cache, table, lens, 0.125,
                                                             window, cap)), (window, cap)
        if own_bits:
            ref = paged_decode_attention_reference(q.float(), cache.float(), table, lens, 0.125,
                                                   window or None, cap or None)
            some = lens > 0
            torch.testing.assert_close(out[some].float(), ref[some], rtol=2 ** -6, atol=2 ** -9)
            assert not out[~some].any()
    if own_bits:
        sdpa = sdpa_reference(q, cache, table, lens, 0.125, torch.bfloat16)
        out = ops.paged_decode_attention(q, cache, table, lens, 0.125)
        assert (out == sdpa)[lens > 0].float().mean() >= 0.85
    # one sequence, short (its groups on the calling thread) and long (over the threads):
    # its bits in the batch again
    for b in (5, 9):
        one = ops.paged_decode_attention(q[b:b + 1], cache, table[b:b + 1], lens[b:b + 1],
                                         0.125, 0, 0.0)
        assert torch.equal(one, first.paged_decode_attention(q, cache, table, lens, 0.125, 0,
                                                             0.0)[b:b + 1])


def test_paged_decode_attention_reads_q_from_a_strided_view(ops):
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32)
    qkv = randn(2, 8 * 16, dtype=torch.float32, seed=1)
    q = qkv[:, :4 * 16].view(2, 4, 16)  # rows 128 apart, not 64
    table, lens = torch.tensor([[2, 0], [1, 3]]), torch.tensor([5, 8])
    torch.testing.assert_close(ops.paged_decode_attention(q, cache, table, lens, 0.25),
                               sdpa_reference(q, cache, table, lens, 0.25))


def test_paged_decode_attention_refuses_a_length_past_its_block_table(ops):
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32)
    q = randn(1, 2, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        ops.paged_decode_attention(q, cache, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)


# -- the small-batch linear ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("out_features,in_features,bias", [
    (960, 576, False), (579, 576, True), (6, 37, False), (3, 64, True)])
def test_linear(ops, dtype, rows, out_features, in_features, bias):
    """Against float64 math on the same values: as accurate as torch's own GEMV. Rows are read
    from a wider tensor (strided rows), and pairs of them share each weight load."""
    x = randn(rows, in_features + 3, dtype=dtype)[:, :in_features]
    w = randn(out_features, in_features, dtype=dtype, seed=1)
    b = randn(out_features, dtype=dtype, seed=2) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    out = ops.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    ours = (out.double() - exact).abs().max().item()
    torchs = (F.linear(x, w, b).double() - exact).abs().max().item()
    if dtype == torch.bfloat16:  # both round a float32 sum once: one bf16 step at most
        torch.testing.assert_close(out.float(), exact.to(dtype).float(), rtol=2 ** -7, atol=0)
    else:
        assert ours <= max(4 * torchs, 1e-5), (ours, torchs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_their_batch(ops, dtype):
    """A row's outputs are the same bits whether it was computed alone or in a batch (paired
    with another row, or the odd one out): the kernel's own arithmetic, on every tier. Against
    torch's one-row bf16 GEMV in this process: one bf16 step at most, because oneDNN picks its
    own summation order per ISA (AVX512-BF16 differs from AVX2); where torch runs its AVX2
    kernels the bits are equal (``test_bf16_linear_row_is_torchs_avx2_gemv``)."""
    x = randn(5, 576, dtype=dtype)
    w = randn(579, 576, dtype=dtype, seed=1)  # a partial tile of 3 output features at the end
    full = ops.linear(x, w, None)  # rows 0-1 and 2-3 paired, row 4 alone
    assert torch.equal(ops.linear(x[3:5], w, None), full[3:5])  # row 3 alone before, paired now
    assert torch.equal(ops.linear(x[1:4], w, None), full[1:4])
    for r in range(5):
        assert torch.equal(ops.linear(x[r:r + 1], w, None), full[r:r + 1])
        if dtype == torch.bfloat16:
            torch.testing.assert_close(full[r:r + 1].float(), F.linear(x[r:r + 1], w).float(),
                                       rtol=2 ** -7, atol=0)


_AVX2_GEMV_CHECK = """
import torch, torch.nn.functional as F
from llmkit.kernels.cpu_native import load_cpu_kernels
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 576, generator=g).bfloat16()
w = torch.randn(579, 576, generator=g).bfloat16()
full = load_cpu_kernels().linear(x, w, None)
print(all(torch.equal(F.linear(x[r:r + 1], w), full[r:r + 1]) for r in range(5)))
"""


@pytest.mark.skipif("avx2" not in cpu_native.cpu_flags(), reason="needs an x86 CPU with AVX2")
def test_bf16_linear_row_is_torchs_avx2_gemv():
    """With torch's own kernels held to AVX2 (they can only be lowered before torch loads: a
    subprocess), a bf16 row is the bits of torch's one-row GEMV, as Hugging Face's model gets
    them decoding one sequence."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", _AVX2_GEMV_CHECK], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "True"


def test_loading_tiers_leaves_each_tiers_build_key_alone():
    """Several tiers load in one process (tests, benchmarks): loading one must not change the
    key another is looked up by (torch's builder appended its libraries to the link flags it
    was handed, so every tier loaded after the first was rebuilt under a new key)."""
    for tier in supported_tiers():
        load_cpu_kernels(tier)
    for tier in supported_tiers():
        fresh = cpu_native._build_key(cpu_native.build_inputs(cpu_native.compile_flags(tier)))
        assert cpu_native.kernels_build_key(tier) == fresh, tier


def test_wrong_dtype_is_a_clear_error(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16 expected"):
        ops.silu_and_mul(torch.zeros(2, 4, dtype=torch.float16))


# -- the platform switch -------------------------------------------------------------------
def cpu_platform_native_bf16(platform: CpuPlatform) -> bool:
    from llmkit.platforms.cpu import has_native_bf16
    return has_native_bf16(platform.isa)


def test_isa_tiers_resolve_and_refuse_what_the_cpu_lacks(monkeypatch):
    """platform.isa: auto is the best supported tier; a lower one is forced; one the CPU
    lacks is a config error naming the key, the value and what is allowed here."""
    from llmkit.config import cpu_isa

    epyc = frozenset({"avx2", "fma", "f16c"})
    assert cpu_isa.supported_tiers(epyc) == ("avx2",)
    xeon = epyc | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni"}
    assert cpu_isa.supported_tiers(xeon) == ("avx2", "avx2_vnni", "avx512", "avx512_vnni")
    cascade = xeon - {"avx_vnni"}  # AVX-512 VNNI without AVX-VNNI: the VNNI tier still runs
    assert cpu_isa.best_tier(cascade) == "avx512_vnni"
    assert cpu_isa.best_tier(frozenset({"sse4_2"})) is None
    assert "-mavxvnni" not in cpu_isa.compile_flags("avx512_vnni")
    assert "-mavx512vnni" in cpu_isa.compile_flags("avx512_bf16")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: epyc)
    assert CpuPlatform(PlatformConfig(name="cpu")).isa == "avx2"
    with pytest.raises(ValueError, match=r"a tier this CPU supports: auto, avx2 \(it lacks "
                                         r"avx512_vnni, avx512bw, avx512dq, avx512f, avx512vl"):
        PlatformConfig(name="cpu", isa="avx512_vnni")
    with pytest.raises(ValueError, match="platform.isa: got 'avx512'; allowed: a tier this CPU"):
        cpu_isa.resolve_tier("avx512")
    with pytest.raises(ValueError, match=r"a tier this CPU supports: auto, avx2 \(it lacks amx_bf16, "
                                         r"amx_int8, amx_tile, avx512_bf16"):
        PlatformConfig(name="cpu", isa="amx")


def test_amx_needs_the_flags_and_the_kernels_grant(monkeypatch):
    """amx is the best tier where /proc/cpuinfo shows the AMX flags and Linux grants the
    process the tile state; without the grant it is refused by name, and auto stays on
    avx512_bf16."""
    from llmkit.config import cpu_isa

    spr = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                     "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
    assert cpu_isa.best_tier(spr) == ("amx" if cpu_isa.amx_tile_state_granted() else "avx512_bf16")
    assert "-mamx-int8" in cpu_isa.compile_flags("amx")
    monkeypatch.setattr(cpu_isa, "amx_tile_state_granted", lambda: False)
    assert cpu_isa.best_tier(spr) == "avx512_bf16"
    with pytest.raises(ValueError, match=r"platform.isa: got 'amx'; allowed: a tier this CPU "
                                         r"supports: .*avx512_bf16 \(the Linux kernel refuses"):
        cpu_isa.resolve_tier("amx", spr)


def test_llmkit_config_refuses_a_tier_the_cpu_lacks(monkeypatch):
    """The same error from the config alone (``llmkit config``), before anything is built."""
    from llmkit.config import cpu_isa
    from llmkit.config.compose import compose_config
    from llmkit.config.errors import ConfigError

    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(ConfigError, match=r"platform.isa: got 'avx512'; allowed: a tier this "
                                          r"CPU supports: auto, avx2 \(it lacks avx512bw"):
        compose_config(["platform.isa=avx512"])



def test_cpu_platform_hands_out_the_kernels_unless_off():
    assert CpuPlatform(PlatformConfig(name="cpu")).native_kernels(torch.bfloat16) is not None
    off = CpuPlatform(PlatformConfig(name="cpu", native_kernels="off"))
    assert off.native_kernels(torch.float32) is None
    # float16 has no kernels: auto computes with torch ops, on is refused at start-up
    assert CpuPlatform(PlatformConfig(name="cpu")).native_kernels(torch.float16) is None
    with pytest.raises(ValueError, match="native_kernels=on.*float16"):
        CpuPlatform(PlatformConfig(name="cpu", native_kernels="on")).native_kernels(
            torch.float16)
    with pytest.raises(ValueError, match="native_kernels=on.*'cuda'"):
        CudaPlatform(PlatformConfig(name="cuda", native_kernels="on")).native_kernels(
            torch.float32)


def test_a_failed_build_warns_under_auto_and_fails_under_on(monkeypatch, caplog):
    def fail(tier=None):
        raise CpuKernelBuildError("building llmkit's CPU kernels failed: no compiler")

    monkeypatch.setattr(cpu_native, "load_cpu_kernels", fail)
    with caplog.at_level(logging.WARNING):
        assert CpuPlatform(PlatformConfig(name="cpu")).native_kernels(torch.float32) is None
    assert "no compiler" in caplog.text and "torch ops" in caplog.text
    with pytest.raises(ValueError, match="native_kernels=on: building .* no compiler"):
        CpuPlatform(PlatformConfig(name="cpu", native_kernels="on")).native_kernels(
            torch.float32)


def test_build_directory_is_keyed_by_everything_the_build_depends_on(tmp_path, monkeypatch):
    """Two environments sharing a home folder (same torch, other include paths: torch's
    build.ninja names them) get two build folders instead of rebuilding each other's."""
    monkeypatch.delenv("LLMKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path))
    flags = cpu_native.compile_flags()
    inputs = cpu_native.build_inputs(flags)
    key = cpu_native._build_key(inputs)
    assert cpu_native.build_directory(key) == tmp_path / "cpu_kernels" / key
    assert cpu_native._build_key(cpu_native.build_inputs(flags)) == key  # stable
    assert cpu_native._build_key(cpu_native.build_inputs(["-O0"])) != key
    assert "-ffp-contract=off" in flags
    assert str(Path(torch.__file__).parent) in inputs["include_paths"]
    other_env = [p.replace(str(Path(torch.__file__).parent), "/other/venv/torch")
                 for p in cpu_native.include_paths()]
    monkeypatch.setattr(cpu_native, "include_paths", lambda: other_env)
    assert cpu_native._build_key(cpu_native.build_inputs(flags)) != key
    monkeypatch.undo()
    for name, value in (("compiler", "/usr/bin/clang++ clang 18"), ("torch", "2.13.1"),
                        ("python", "cpython-312 linux-x86_64")):
        assert cpu_native._build_key({**inputs, name: value}) != key, name


def test_cache_folder_has_one_variable_and_the_old_name_warns(tmp_path, monkeypatch):
    from llmkit.config.paths import cache_dir

    monkeypatch.delenv("LLMKIT_CACHE", raising=False)
    monkeypatch.delenv("LLMKIT_CACHE_DIR", raising=False)
    assert cache_dir() == Path("~/.cache/llmkit").expanduser()
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="LLMKIT_CACHE_DIR is deprecated; set LLMKIT_CACHE"):
        assert cache_dir() == tmp_path / "old"
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "new"))
    assert cache_dir() == tmp_path / "new"
    assert cpu_native.build_directory("k") == tmp_path / "new" / "cpu_kernels" / "k"


def test_auto_dtype_is_the_platforms_one_choice(monkeypatch):
    """model.dtype=auto follows the tier in use (platform.isa), not the CPU's best: bf16 with
    native bf16 (AVX512-BF16), or with the C++ kernels on an AVX2 tier (their linear decodes
    bf16); float32 when the kernels are off, cannot be built, or the CPU has no AVX2."""
    from llmkit.config import cpu_isa

    avx2 = CpuPlatform(PlatformConfig(name="cpu", isa="avx2"))
    assert avx2.isa == "avx2" and not cpu_platform_native_bf16(avx2)
    assert avx2.preferred_dtype() == torch.bfloat16
    off = CpuPlatform(PlatformConfig(name="cpu", isa="avx2", native_kernels="off"))
    assert off.preferred_dtype() == torch.float32
    if "avx512_bf16" in supported_tiers():
        native = CpuPlatform(PlatformConfig(name="cpu", isa="avx512_bf16", native_kernels="off"))
        assert native.preferred_dtype() == torch.bfloat16  # native bf16: no kernels needed

    def fail(tier=None):
        raise CpuKernelBuildError("no compiler")

    monkeypatch.setattr(cpu_native, "load_cpu_kernels", fail)
    assert CpuPlatform(PlatformConfig(name="cpu", isa="avx2")).preferred_dtype() == torch.float32
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"sse4_2"}))
    no_avx2 = CpuPlatform(PlatformConfig(name="cpu"))
    assert no_avx2.isa is None and no_avx2.preferred_dtype() == torch.float32
    from llmkit.worker.model_setup import resolve_dtype
    assert resolve_dtype("auto", off) == torch.float32
    assert resolve_dtype("bfloat16", off) == torch.bfloat16
