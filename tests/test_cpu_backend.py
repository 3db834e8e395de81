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
from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.platforms import CpuPlatform
from helpers.attention_cases import attention_case, engine_greedy_tokens


def test_registered_and_cpu_default():
    assert ATTENTION_BACKENDS.get("cpu") is CpuAttentionBackend
    assert CpuPlatform.default_attention == "cpu"


@pytest.fixture(params=["compiled", "gathered"])
def decode_path(request):
    """Run decode rows through the compiled paged kernel, or the small-batch gather path
    (``(name, dispatch table)``)."""
    rows = 1 if request.param == "compiled" else 1000
    return request.param, CpuDispatch(attention_min_compiled_decode_rows=rows)


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

    path, dispatch = decode_path
    backend = CpuAttentionBackend(dispatch=dispatch)
    cmeta = backend.build_metadata(meta)
    assert isinstance(cmeta, CpuAttentionMetadata)
    assert cmeta.all_decode == (max(q_lens) == 1 and path == "compiled")
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


def test_engine_greedy_cpu_equals_torch(tiny_model_dir):
    """Greedy tokens of a tiny random Llama (float32) are identical with attention=cpu and
    attention=torch, with chunked prefills next to decodes and prefix-cache hits."""
    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    shared = [rng.randrange(5, 600) for _ in range(20)]
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 17, 40)]
    prompts += [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    groups = dict(kv_cache={"num_blocks": 48, "block_size": 4},
                  scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 4},
                  platform={"dispatch": {"attention_min_compiled_decode_rows": 2}})
    expected, _ = engine_greedy_tokens(model_dir, "torch", prompts, params, **groups)
    got, cached = engine_greedy_tokens(model_dir, "cpu", prompts, params, **groups)
    assert cached > 0
    assert got == expected
