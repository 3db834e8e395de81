"""Sliding-window masks and attention-logit soft-capping in every attention backend (issue 33):
each backend's ``forward(..., sliding_window=W, logits_soft_cap=c)`` against a per-token dense
reference (the query at position p sees keys p-W+1..p, HF's convention; scores ``c*tanh(s/c)``),
over float, narrower-float and quantized caches, with decodes, fresh prompts and chunked
prefills in one step -- and no block wholly before a row's window is ever read: those block
table entries point at a block of NaN bytes, which would poison the output if touched."""
from __future__ import annotations

import math

import pytest
import torch

from llmkit.attention.base import AttentionBackend
from llmkit.attention.cpu_backend import CpuAttentionBackend
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.attention.triton_backend import TritonAttentionBackend
from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.kernels.kv_quant import FORMATS, cache_row_width, read_rows, to_cache_rows
from llmkit.ops.base import ModelOps
from helpers.attention_cases import step_metadata

WINDOW, CAP, BLOCK = 7, 2.5, 4
CASES = {
    # decodes, a fresh prompt, chunked prefills (one longer than the CPU's expanded rows)
    "mixed": ([1, 6, 13, 1, 3, 20], [20, 0, 9, 33, 30, 5]),
    "decode": ([1, 1, 1, 1], [40, 3, 70, 6]),
}
MODES = {"window": (WINDOW, None), "cap": (None, CAP), "both": (WINDOW, CAP),
         "window1": (1, None)}
KINDS = ["float32", "bfloat16", "int8", "fp8_e4m3"]


def _storage(kind: str) -> torch.dtype:
    return FORMATS[kind].storage_dtype if kind in FORMATS else getattr(torch, kind)


def make_case(case: str, kind: str, window: int | None, *, heads=8, kv_heads=2, dim=32,
              dtype=torch.float32, seed=0):
    q_lens, ctx_lens = CASES[case]
    g = torch.Generator().manual_seed(seed)
    per_req = max(math.ceil((q + c) / BLOCK) for q, c in zip(q_lens, ctx_lens))
    num_blocks = len(q_lens) * per_req + 1
    poison = num_blocks - 1
    table = torch.randperm(num_blocks - 1, generator=g).view(len(q_lens), per_req)
    table = table.to(torch.int32)
    meta = step_metadata(q_lens, ctx_lens, BLOCK, table, pad_tokens=2)
    clean = table.clone()
    if window is not None:  # blocks wholly before the first query's window: never read
        for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
            first = max(0, c - window + 1)
            table[i, :first // BLOCK] = poison
    n = meta.num_actual_tokens + 2
    q = (torch.randn(n, heads, dim, generator=g) * 3).to(dtype)  # peaked: the cap matters
    kv = torch.randn(n, 2 * kv_heads, dim, generator=g).to(dtype)
    storage = _storage(kind)
    width = cache_row_width(dim, storage) if kind in FORMATS else dim
    shape = AttentionBackend.kv_cache_shape(num_blocks, BLOCK, kv_heads, width)
    cache = torch.zeros(shape, dtype=storage)
    filled = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=g)
    cache.copy_(to_cache_rows(filled, storage).view(shape))
    cache.view(torch.uint8)[:, poison] = 255  # NaN in every format
    return meta, q, kv[:, :kv_heads], kv[:, kv_heads:], cache, dim ** -0.5, clean


def dense_reference(q, cache, meta, scale, window, cap, table=None):
    """Token by token: the positions it may see, gathered, soft-capped, softmaxed."""
    table = meta.block_table if table is None else table
    hkv, bs = cache.shape[3], cache.shape[2]
    flat = cache.view(2, -1, hkv, cache.shape[-1])
    group = q.shape[1] // hkv
    out = torch.zeros(meta.num_actual_tokens, *q.shape[1:])
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(meta.num_reqs):
        for t in range(qsl[i], qsl[i + 1]):
            p = lens[i] - (qsl[i + 1] - t)
            pos = torch.arange(0 if window is None else max(0, p - window + 1), p + 1)
            slots = table[i, pos // bs].long() * bs + pos % bs
            k = read_rows(flat[0][slots], torch.float32).repeat_interleave(group, 1)
            v = read_rows(flat[1][slots], torch.float32).repeat_interleave(group, 1)
            s = torch.einsum("hd,nhd->hn", q[t].float(), k) * scale
            if cap is not None:
                s = torch.tanh(s / cap) * cap
            out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def cpu_native_ops():
    from llmkit.kernels.cpu_native import load_cpu_kernels
    from llmkit.ops.cpu_ops import CpuNativeOps

    return CpuNativeOps(load_cpu_kernels())


BACKENDS = {
    "torch": lambda: TorchAttentionBackend(),
    "cpu-native": lambda: CpuAttentionBackend(cpu_native_ops()),
    "cpu-compiled": lambda: CpuAttentionBackend(
        dispatch=CpuDispatch(attention_min_compiled_decode_rows=1)),
    "cpu-gathered": lambda: CpuAttentionBackend(
        dispatch=CpuDispatch(attention_min_compiled_decode_rows=1000)),
}


def check(backend, case, kind, mode, dtype=torch.float32, tol=2e-5):
    window, cap = MODES[mode]
    meta, q, k, v, cache, scale, clean = make_case(case, kind, window, dtype=dtype)
    bmeta = backend.build_metadata(meta)
    out = backend.forward(q, k, v, cache, bmeta, scale, sliding_window=window,
                          logits_soft_cap=cap)
    n = meta.num_actual_tokens
    want = dense_reference(q, cache, meta, scale, window, cap)
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n].float(), want, rtol=tol, atol=tol)
    if window is not None and mode != "window1":
        plain = dense_reference(q, cache, meta, scale, None, None, clean)
        assert (want - plain).abs().max() > 0.1  # the window is shorter than the context
    if cap is not None:
        assert (want - dense_reference(q, cache, meta, scale, window, None)).abs().max() > 0.1
    return backend, bmeta, (q, k, v, cache, scale), clean


# every mode over a float32 cache, every cache kind with both the window and the cap
KIND_MODES = [("float32", m) for m in MODES] + [(k, "both") for k in KINDS[1:]]


@pytest.mark.parametrize("kind,mode", KIND_MODES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_window_and_soft_cap(name, case, kind, mode):
    check(BACKENDS[name](), case, kind, mode)


@pytest.mark.parametrize("name", ["torch", "cpu-native", "cpu-gathered"])
def test_full_layer_after_a_windowed_one(name):
    """One metadata for every layer (one KV-cache group): windowed plans are kept per window
    on the step's metadata, and a full-attention layer of the same step still sees its whole
    context."""
    meta, q, k, v, cache, scale, _ = make_case("mixed", "float32", None)
    backend = BACKENDS[name]()
    bmeta = backend.build_metadata(meta)
    n = meta.num_actual_tokens
    for window, cap in [(WINDOW, CAP), (None, None), (3, None)]:
        out = backend.forward(q, k, v, cache, bmeta, scale, sliding_window=window,
                              logits_soft_cap=cap)
        torch.testing.assert_close(out[:n], dense_reference(q, cache, meta, scale, window, cap),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_native_bfloat16_window_and_soft_cap(case):
    """bf16 q and cache through the C++ kernels' SDPA-order path: within bf16 rounding."""
    check(CpuAttentionBackend(cpu_native_ops()), case, "bfloat16", "both",
          dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("mode", ["window", "both", "window1"])
@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_window_and_soft_cap(monkeypatch, case, kind, mode):
    """Both Triton kernels (unified for the mixed step, split decode for the decode-only one:
    the splits start at the window) under the interpreter."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_target_programs", 64)
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_min_len", 2)
    monkeypatch.setattr(TritonAttentionBackend, "kv_split_max", 3)
    check(TritonAttentionBackend(), case, kind, mode, tol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_ops_reference_decode_reads_only_the_window(window):
    """The ops' torch reference (the platform-less decode path) skips pre-window blocks too."""
    meta, q, k, v, cache, scale, _ = make_case("decode", "float32", window)
    ModelOps().write_kv(k[:4], v[:4], cache, meta.slot_mapping[:4])
    out = ModelOps().paged_decode_attention(q[:4], cache, meta.block_table, meta.seq_lens,
                                            scale, window, CAP)
    torch.testing.assert_close(out, dense_reference(q, cache, meta, scale, window, CAP),
                               rtol=2e-5, atol=2e-5)
