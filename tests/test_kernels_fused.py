"""Fused elementwise kernels of llmkit.kernels against their torch references: RMSNorm (alone
and with the residual add fused), rotary embedding (neox and GPT-J layouts, in place on q and
k views of a fused qkv tensor), SiLU-and-mul. Interpreter mode without CUDA (float32)."""
from __future__ import annotations

import pytest
import torch

from llmkit.kernels import KernelLaunchError, count_launches
from llmkit.kernels.activation import silu_and_mul, silu_and_mul_ref
from llmkit.kernels.norm import (fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm,
                                 rms_norm_ref)
from llmkit.kernels.rotary import rotary_embedding, rotary_embedding_ref
from helpers.kernel_inputs import tolerances
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.rotary import RotaryEmbedding, apply_rotary
from llmkit.ops.base import ModelOps

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32 = tolerances(torch.float32)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE.type != "cuda":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# ------------------------------------------------------------------------ RMSNorm

@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 576), (3, 4096)])
def test_rms_norm(rows, hidden):
    x, w = randn(rows, hidden, seed=1), randn(hidden, seed=2)
    with count_launches() as launches:
        out = rms_norm(x, w, 1e-6)
    assert launches["_rms_norm_kernel"] == 1
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **F32)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (9, 96), (17, 576)])
def test_fused_add_rms_norm(rows, hidden):
    x, res, w = randn(rows, hidden, seed=3), randn(rows, hidden, seed=4), randn(hidden, seed=5)
    res_ref = res.clone()
    out, res_out = fused_add_rms_norm(x, res, w, 1e-5)
    expected, expected_res = fused_add_rms_norm_ref(x, res_ref, w, 1e-5)
    assert res_out is res  # updated in place, like the model's RMSNorm
    torch.testing.assert_close(res, expected_res, **F32)
    torch.testing.assert_close(out, expected, **F32)


def test_rms_norm_matches_model_layer():
    """Same results as llmkit.models.layers.RMSNorm, with and without the residual."""
    layer = RMSNorm(64, 1e-6, torch.float32, ModelOps()).to(DEVICE)
    layer.weight.copy_(randn(64, seed=6))
    x, res = randn(5, 64, seed=7), randn(5, 64, seed=8)
    torch.testing.assert_close(rms_norm(x, layer.weight, 1e-6), layer(x), **F32)
    res_layer = res.clone()
    out_layer, _ = layer(x, res_layer)
    out, _ = fused_add_rms_norm(x, res, layer.weight, 1e-6)
    torch.testing.assert_close(out, out_layer, **F32)
    torch.testing.assert_close(res, res_layer, **F32)


# ------------------------------------------------------------------------ rotary

@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [
    (64, 4, 1), (128, 8, 2), (80, 4, 4), (96, 3, 1),
])
def test_rotary_embedding(is_neox, head_dim, num_heads, num_kv_heads):
    tokens, max_pos = 6, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cache = RotaryEmbedding(head_dim, max_pos, inv_freq, 1.0, torch.float32).cos_sin_cache
    cache = cache.to(DEVICE)
    positions = torch.tensor([0, 5, 63, 17, 17, 2], device=DEVICE)
    # q and k as views of one fused qkv projection (strided, last dim contiguous).
    qkv = randn(tokens, num_heads + 2 * num_kv_heads, head_dim, seed=head_dim)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    q_ref, k_ref = q.clone(), k.clone()
    v_before = qkv[:, num_heads + num_kv_heads:].clone()
    with count_launches() as launches:
        rotary_embedding(positions, q, k, cache, is_neox)
    assert launches["_rotary_kernel"] == 1
    rotary_embedding_ref(positions, q_ref, k_ref, cache, is_neox)
    torch.testing.assert_close(q, q_ref, **F32)
    torch.testing.assert_close(k, k_ref, **F32)
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], v_before)  # v untouched


def test_rotary_matches_model_apply_rotary():
    head_dim, max_pos = 64, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cache = RotaryEmbedding(head_dim, max_pos, inv_freq, 1.0, torch.float32).cos_sin_cache
    positions = torch.tensor([3, 0, 31], device=DEVICE)
    q, k = randn(3, 4, head_dim, seed=1), randn(3, 2, head_dim, seed=2)
    cos, sin = cache.to(DEVICE)[positions].unsqueeze(1).chunk(2, dim=-1)
    q_model, k_model = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotary_embedding(positions, q, k, cache.to(DEVICE), True)
    torch.testing.assert_close(q, q_model, **F32)
    torch.testing.assert_close(k, k_model, **F32)


def test_rotary_partial_rot_dim():
    head_dim, rot_dim = 64, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    cache = RotaryEmbedding(rot_dim, 16, inv_freq, 1.0, torch.float32).cos_sin_cache.to(DEVICE)
    positions = torch.tensor([1, 9], device=DEVICE)
    q, k = randn(2, 2, head_dim, seed=3), randn(2, 1, head_dim, seed=4)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, False)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, False)
    torch.testing.assert_close(q, q_ref, **F32)
    torch.testing.assert_close(k, k_ref, **F32)


# ------------------------------------------------------------------------ SiLU-and-mul

@pytest.mark.parametrize("shape", [(1, 128), (5, 200), (17, 3000), (2, 3, 64)])
def test_silu_and_mul(shape):
    x = randn(*shape, seed=shape[0]) * 4
    with count_launches() as launches:
        out = silu_and_mul(x)
    assert launches["_silu_and_mul_kernel"] == 1
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **F32)


# ------------------------------------------------------------------------ interpreter handling

def test_cpu_launch_without_interpreter_fails_clearly(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("compiles on CUDA")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelLaunchError, match="TRITON_INTERPRET=1"):
        silu_and_mul(torch.randn(2, 8))


def test_interpreter_works_when_triton_was_imported_first():
    """Triton makes its library functions (tl.sum, tl.max ...) compiled-mode or interpreted
    when triton.language is imported. In this process it was imported (collecting this module)
    before the fixture set TRITON_INTERPRET, so they are compiled-mode: every interpreted test
    here exercises llmkit's launcher, which runs them through the interpreter anyway."""
    if DEVICE.type == "cuda":
        pytest.skip("compiles on CUDA")
    import triton.language.standard as std
    from triton.runtime.jit import JITFunction

    if not isinstance(std.sum, JITFunction):
        pytest.skip("TRITON_INTERPRET was already set when triton.language was imported")
    x, w = randn(3, 64, seed=9), randn(64, seed=10)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **F32)
    assert isinstance(std.sum, JITFunction)  # Triton's own objects are left as they were
    assert "__call__" in JITFunction.__dict__
