"""The ``cpu`` attention backend (the CPU default): the compiled paged decode kernel and the
flash prefill path give the ``torch`` reference backend's results, alone and in the engine, with
grouped-query and plain heads, and it is what ``attention=auto`` picks on a CPU."""
from __future__ import annotations

import random

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.attention import ATTENTION_BACKENDS
from llmkit.attention.cpu_backend import (CpuAttentionBackend, CpuAttentionMetadata,
                                          paged_decode_attention)
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.platforms import CpuPlatform
from attention_cases import attention_case, engine_greedy_tokens


def test_registered_and_cpu_default():
    assert ATTENTION_BACKENDS.get("cpu") is CpuAttentionBackend
    assert CpuPlatform.default_attention == "cpu"


@pytest.fixture(params=["compiled", "gathered"])
def decode_path(request, monkeypatch):
    """Run decode rows through the compiled paged kernel, or the small-batch gather path."""
    rows = 1 if request.param == "compiled" else 1000
    monkeypatch.setattr(CpuAttentionBackend, "min_compiled_decode_rows", rows)
    return request.param


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 6, 13, 1], [20, 0, 9, 33]),  # mixed: decodes, a fresh prefill, a chunked prefill
    ([1, 1, 1], [40, 3, 70]),  # decodes only
    ([1], [0]),  # one decode row with one token of context
], ids=["mixed", "decode", "single"])
def test_forward_matches_torch_backend(q_lens, ctx_lens, num_heads, num_kv_heads, decode_path):
    case = attention_case(q_lens, ctx_lens, num_heads, num_kv_heads,
                          seed=len(q_lens) + num_heads)
    q, k, v, cache, cache_ref, meta, scale = (
        case.q, case.k, case.v, case.cache, case.cache_ref, case.meta, case.scale)

    backend = CpuAttentionBackend()
    cmeta = backend.build_metadata(meta)
    assert isinstance(cmeta, CpuAttentionMetadata)
    assert cmeta.all_decode == (max(q_lens) == 1 and decode_path == "compiled")
    out = backend.forward(q, k, v, cache, cmeta, scale)
    expected = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, scale)
    m = meta.num_actual_tokens
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)
    torch.testing.assert_close(out[:m], expected[:m], rtol=1e-5, atol=1e-5)


def test_decode_kernel_in_bfloat16_matches_float32_math():
    """bf16 q and cache: the kernel computes in float32 and rounds once, like SDPA's CPU kernel."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 10, 4, 2, 16, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 6, 16, generator=g).to(torch.bfloat16)
    table = torch.tensor([[3, 1, 7], [0, 2, 9], [5, 5, 5]])
    lens = torch.tensor([11, 5, 1])
    got = CpuAttentionBackend()._kernel(q, cache, table, lens, 0.25)
    want = paged_decode_attention(q.float(), cache.float(), table, lens, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-2)


def test_engine_greedy_cpu_equals_torch(tiny_model_dir, monkeypatch):
    """Greedy tokens of a tiny random Llama (float32) are identical with attention=cpu and
    attention=torch, with chunked prefills next to decodes and prefix-cache hits."""
    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    shared = [rng.randrange(5, 600) for _ in range(20)]
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 17, 40)]
    prompts += [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    groups = dict(kv_cache={"num_blocks": 48, "block_size": 4},
                  scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 4})

    monkeypatch.setattr(CpuAttentionBackend, "min_compiled_decode_rows", 2)
    expected, _ = engine_greedy_tokens(model_dir, "torch", prompts, params, **groups)
    got, cached = engine_greedy_tokens(model_dir, "cpu", prompts, params, **groups)
    assert cached > 0
    assert got == expected


@pytest.mark.parametrize("rows", [1, 64, 600])  # 600 > packed_max_rows: the plain MKL path
def test_packed_linear_matches_plain(rows):
    from llmkit.models.layers.linear import Linear

    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 80, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g))
        layer.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(rows, 96, generator=g)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.pack_weight()
    assert layer.packed_weight is not None
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


def test_packed_linear_refuses_bfloat16():
    from llmkit.models.layers.linear import Linear

    with pytest.raises(ValueError, match="float32"):
        Linear(8, 8, bias=False, dtype=torch.bfloat16).pack_weight()


def test_bfloat16_linear_in_float32_matches_bfloat16_gemm():
    """A bf16 layer computed in float32 (CPUs without native bf16): same products, float32
    accumulation, bf16 output, so it equals torch's bf16 GEMM up to summation order. One row
    goes through torch's bf16 GEMV on the bf16 weight itself: exactly torch's bf16 result."""
    from llmkit.models.layers.linear import Linear

    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 80, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g))
        layer.bias.copy_(torch.randn(80, generator=g))
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_weight(compute_in_float32=True)
    assert layer.weight.dtype == torch.bfloat16 and layer.io_dtype == torch.bfloat16
    assert layer.weight_float32.dtype == torch.float32
    for rows in (1, 2, 64, 600):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        want = torch.nn.functional.linear(x, w, b)
        exact = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        got = layer(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
        if rows == 1:
            assert torch.equal(got, want)


def test_engine_packs_linears_on_cpu(tiny_model_dir):
    """The CPU platform packs float32 weights (the greedy-vs-HF tests then run packed) and,
    without native bf16, runs bf16 linears in float32; ``platform.packed_linear=false`` turns
    both off, with identical greedy tokens."""
    from llmkit.models.layers.linear import Linear
    from llmkit.platforms.cpu import has_native_bf16

    model_dir = tiny_model_dir("llama")
    prompts = [[5, 9, 33, 2, 71], [8] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(packed, dtype):
        llm = LLM(str(model_dir), dtype=dtype, overrides=[f"platform.packed_linear={packed}"])
        model = llm.engine.executor.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        want = packed and (dtype == "float32" or not has_native_bf16())
        assert linears and all((m.packed_weight is not None) == want for m in linears)
        assert all((m.io_dtype is not None) == (want and dtype == "bfloat16") for m in linears)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run(True, "float32") == run(False, "float32")
    assert run(True, "bfloat16") == run(False, "bfloat16")
