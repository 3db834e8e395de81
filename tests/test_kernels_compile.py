"""Every launch configuration the launchers produce for a serving-sized bf16 model compiles
with Triton's real compiler for sm_90 (Hopper) -- down to a cubin, with the ptxas that ships
with Triton, no GPU needed. The interpreter tests check what the kernels compute; this checks
what only the compiler sees (types, ``tl.dot`` shapes, shared memory). Launches are recorded as
a dry run (nothing executes)."""
from __future__ import annotations

import pytest
import torch

from llmkit.kernels import (fused_add_rms_norm, paged_decode_attention, reshape_and_cache,
                            rotary_embedding, silu_and_mul, unified_attention)
from llmkit.kernels._jit import record_launches
from llmkit.kernels.aot import compile_launch, signature

pytestmark = pytest.mark.slow

H100_SHARED_MEMORY = 227 * 1024


def _launches(dtype):
    """Llama-3-8B shapes: 32 query heads, 8 KV heads, head_dim 128, block size 16."""
    heads, kv_heads, d, bs = 32, 8, 128, 16
    cache = torch.empty(2, 64, bs, kv_heads, d, dtype=dtype)
    bt = torch.zeros(4, 16, dtype=torch.int32)
    seq_lens = torch.tensor([200, 1, 77, 256], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 70, 71], dtype=torch.int32)
    with record_launches(execute=False) as launches:
        kv = torch.empty(71, 2 * kv_heads, d, dtype=dtype)
        reshape_and_cache(kv[:, :kv_heads], kv[:, kv_heads:], cache,
                          torch.zeros(71, dtype=torch.int64))
        q = torch.empty(4, heads, d, dtype=dtype)
        paged_decode_attention(q, cache, bt, seq_lens, 0.088, num_splits=1)
        paged_decode_attention(q, cache, bt, seq_lens, 0.088, num_splits=8)
        q = torch.empty(71, heads, d, dtype=dtype)
        unified_attention(q, cache, qsl, seq_lens, bt, 0.088)
        x = torch.empty(71, 4096, dtype=dtype)
        fused_add_rms_norm(x, torch.empty_like(x), torch.empty(4096, dtype=dtype), 1e-5)
        qkv = torch.empty(71, heads + 2 * kv_heads, d, dtype=dtype)
        rotary_embedding(torch.zeros(71, dtype=torch.int64), qkv[:, :heads],
                         qkv[:, heads:heads + kv_heads], torch.empty(8192, d, dtype=dtype))
        silu_and_mul(torch.empty(71, 2 * 14336, dtype=dtype))
    return launches


def test_every_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, leave no cache
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    seen = {}
    for launch in _launches(torch.bfloat16):
        sig, constexprs = signature(launch)
        seen.setdefault((launch.kernel.name, repr(sorted(sig.items())),
                         repr(sorted(constexprs.items()))), launch)
    names = {key[0] for key in seen}
    assert names == {"_reshape_and_cache_kernel", "_paged_decode_kernel",
                     "_decode_reduce_kernel", "_unified_attention_kernel", "_rms_norm_kernel",
                     "_rotary_kernel", "_silu_and_mul_kernel"}
    for (name, _, constexprs), launch in seen.items():
        compiled = compile_launch(launch, arch=90)
        assert compiled.metadata.shared <= H100_SHARED_MEMORY, (name, constexprs)


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8_e4m3"])
def test_quantized_cache_attention_compiles_for_sm90(tmp_path, monkeypatch, storage):
    """The attention kernels over a quantized cache (kv_quant rows: head_dim codes + a float32
    scale), whose loads dequantize in ``paged_kv.load_kv_tile``, a device function the kernels
    call: the compiler must inline it with both QUANT branches."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    heads, kv_heads, d, bs = 32, 8, 128, 16
    cache = torch.empty(2, 64, bs, kv_heads, d + 4, dtype=storage)
    bt = torch.zeros(4, 16, dtype=torch.int32)
    seq_lens = torch.tensor([200, 1, 77, 256], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 70, 71], dtype=torch.int32)
    with record_launches(execute=False) as launches:
        paged_decode_attention(torch.empty(4, heads, d, dtype=torch.bfloat16), cache, bt,
                               seq_lens, 0.088)
        unified_attention(torch.empty(71, heads, d, dtype=torch.bfloat16), cache, qsl, seq_lens,
                          bt, 0.088)
    assert [(launch.kernel.name, launch.kwargs["QUANT"]) for launch in launches] == [
        ("_paged_decode_kernel", 1 if storage == torch.int8 else 2),
        ("_unified_attention_kernel", 1 if storage == torch.int8 else 2)]
    for launch in launches:
        assert compile_launch(launch, arch=90).metadata.shared <= H100_SHARED_MEMORY


def test_mla_kernels_compile_for_sm90(tmp_path, monkeypatch):
    """MLA's latent write and absorbed decode (``kernels/mla_attention.py``) at DeepSeek-V2-Lite
    shapes (16 heads, kv_lora_rank 512, rope 64), bf16, with and without split-KV: the
    ``[BLOCK_N, 512]`` latent tile and the ``[16, 512]`` float32 accumulator must fit."""
    from llmkit.kernels import mla_decode_attention, write_latent_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    heads, rank, rope, bs = 16, 512, 64, 16
    cache = torch.empty(64, bs, rank + rope, dtype=torch.bfloat16)
    bt = torch.zeros(4, 16, dtype=torch.int32)
    seq_lens = torch.tensor([200, 1, 77, 256], dtype=torch.int32)
    with record_launches(execute=False) as launches:
        write_latent_cache(torch.empty(71, rank + rope, dtype=torch.bfloat16), cache,
                           torch.zeros(71, dtype=torch.int64))
        q_latent = torch.empty(4, heads, rank, dtype=torch.bfloat16)
        q_pe = torch.empty(4, heads, rope, dtype=torch.bfloat16)
        mla_decode_attention(q_latent, q_pe, cache, bt, seq_lens, 0.07, num_splits=1)
        mla_decode_attention(q_latent, q_pe, cache, bt, seq_lens, 0.07, num_splits=4)
    assert [launch.kernel.name for launch in launches] == [
        "_write_latent_kernel", "_mla_decode_kernel", "_mla_decode_kernel",
        "_decode_reduce_kernel"]
    for launch in launches:
        assert compile_launch(launch, arch=90).metadata.shared <= H100_SHARED_MEMORY
