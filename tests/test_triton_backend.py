"""The ``triton`` attention backend: same results as the ``torch`` reference backend, alone and
inside the engine (greedy tokens on a tiny random Llama), every kernel of the backend launched;
a clear start-up error where it cannot run; the default on CUDA."""
from __future__ import annotations

import random

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.attention import ATTENTION_BACKENDS
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
from llmkit.config.errors import ConfigError
from llmkit.kernels import count_launches
from helpers.kernel_inputs import tolerances
from llmkit.platforms import CudaPlatform
from helpers.attention_cases import attention_case, engine_greedy_tokens

BACKEND_KERNELS = {"_reshape_and_cache_kernel", "_paged_decode_kernel", "_decode_reduce_kernel",
                   "_unified_attention_kernel"}
CUDA = torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def split_decodes(monkeypatch):
    """Split short decodes over the KV length (flash-decoding), so tiny tests use the reduce
    kernel too: aim for 64 programs, >= 8 tokens a split, at most 3 splits."""
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_target_programs", 64)
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_min_len", 8)
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_max", 3)


def test_registered_and_cuda_default():
    assert "triton" in ATTENTION_BACKENDS
    assert ATTENTION_BACKENDS.get("triton") is TritonAttentionBackend
    assert CudaPlatform.default_attention == "triton"


@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 6, 13, 1], [20, 0, 9, 33]),  # mixed: decodes, a prefill, a chunked prefill
    ([1, 1, 1], [40, 3, 70]),  # decodes only: the paged decode kernel (split)
], ids=["mixed", "decode"])
def test_backend_forward_matches_torch_backend(interpret, split_decodes, q_lens, ctx_lens):
    case = attention_case(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, seed=len(q_lens))
    q, k, v, cache, cache_ref, meta, scale = (
        case.q, case.k, case.v, case.cache, case.cache_ref, case.meta, case.scale)

    backend = TritonAttentionBackend()
    tmeta = backend.build_metadata(meta)
    assert isinstance(tmeta, TritonAttentionMetadata)
    assert tmeta.decode_only == (max(q_lens) == 1)
    with count_launches() as launches:
        out = backend.forward(q, k, v, cache, tmeta, scale)
        out2 = backend.forward(q, k, v, cache, tmeta, scale)  # a 2nd layer: reuses
    expected = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, scale)
    m = meta.num_actual_tokens
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)
    torch.testing.assert_close(out[:m], expected[:m], **tolerances(torch.float32))
    torch.testing.assert_close(out2[:m], out[:m], rtol=0, atol=0)
    expected_kernels = {"_reshape_and_cache_kernel"} | (
        {"_paged_decode_kernel", "_decode_reduce_kernel"} if tmeta.decode_only
        else {"_unified_attention_kernel"})
    assert set(launches) == expected_kernels
    assert all(c == 2 for c in launches.values())


def test_triton_on_cpu_without_interpreter_fails_at_start(tiny_model_dir, monkeypatch):
    if CUDA:
        pytest.skip("the triton backend runs on this machine's GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_model_dir("llama")), dtype="float32", attention="triton")
    msg = str(err.value)
    assert msg.startswith("attention.name: 'triton' cannot run on platform 'cpu'")
    assert "TRITON_INTERPRET=1" in msg and "attention=torch" in msg


@pytest.mark.skipif(CUDA, reason="the interpreter's case: a CPU without a GPU")
def test_interpreted_triton_runs_eagerly_under_step_graphs(tiny_model_dir, interpret, caplog):
    """attention=triton under TRITON_INTERPRET=1 on a CPU with compilation.mode=graphs (how the
    README says to try the kernels): inductor cannot trace the interpreted kernels, so the
    backend reports no graph-safe decode and decode steps run eagerly, with the platform's
    warning, giving the torch backend's greedy tokens (before, dynamo failed in the first
    decode step)."""
    import logging

    model_dir = tiny_model_dir("qwen2")
    prompts = [[7, 42, 99, 5], [300, 12, 8, 64, 150, 33]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    groups = dict(kv_cache={"num_blocks": 16, "block_size": 16})
    assert not TritonAttentionBackend().supports_step_graphs

    expected, _ = engine_greedy_tokens(model_dir, "torch", prompts, params, **groups)
    with caplog.at_level(logging.WARNING, logger="llmkit"):
        got, _ = engine_greedy_tokens(model_dir, "triton", prompts, params,
                                      compilation={"mode": "graphs"}, **groups)
    assert got == expected
    assert any("no graph-safe decode path" in r.getMessage() and "'triton'" in r.getMessage()
               for r in caplog.records)


def test_compiled_triton_supports_step_graphs(monkeypatch):
    """Without the interpreter (compiled kernels, CUDA) the backend keeps its graph-safe
    decode."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonAttentionBackend().supports_step_graphs


def test_engine_greedy_triton_equals_torch(tiny_model_dir, interpret, split_decodes):
    """A few greedy tokens of a tiny random Llama (float32): identical with attention=triton and
    attention=torch. A small token budget makes steps with chunked prefills next to decodes."""
    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    groups = dict(kv_cache={"num_blocks": 24, "block_size": 16},
                  scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 4})

    expected, _ = engine_greedy_tokens(model_dir, "torch", prompts, params, **groups)
    with count_launches() as launches:
        got, _ = engine_greedy_tokens(model_dir, "triton", prompts, params, **groups)
    assert got == expected
    missing = BACKEND_KERNELS - set(launches)
    assert not missing, f"kernels never launched: {sorted(missing)}"
