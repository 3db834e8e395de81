"""KV-cache quantization (``kv_cache.cache_dtype=int8|fp8_e4m3``, also bfloat16/float16 under
a float32 model): every writer stores the bits of the torch reference (``llmkit.kernels.
kv_quant``), every reader dequantizes them the same way, the pool holds more blocks, and bad
values fail at start-up.

Kernels: the C++ CPU ops and the Triton kernels (interpreted) against the torch reference --
writes bit for bit, attention within float32 rounding of the reference that gathers and
dequantizes the same codes. Engine: greedy tokens with a quantized pool equal those of a
reference engine whose attention reads the same dequantized values (the torch backend over a
float32 pool into which K/V are written already quantized-and-dequantized): any difference
left is float32 summation order, which the tiny model's peaked logits (weights x3) absorb.
"""
from __future__ import annotations

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.config import compose_config
from llmkit.config.errors import ConfigError
from llmkit.engine.loop.components import validate_components
from llmkit.kernels import count_launches
from llmkit.kernels.kv_quant import (FORMATS, FP8_E4M3, INT8, SCALE_BYTES, dequantize_rows,
                                     fake_quantize, format_of, quantize_rows)
from llmkit.ops.base import ModelOps

FMTS = [INT8, FP8_E4M3]
F32 = {"atol": 5e-5, "rtol": 1e-4}


def randn(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def quantized_cache(fmt, num_blocks, block_size, heads, head_dim, seed=0):
    """A pool of random rows (quantized from random floats, wide-ranging scales)."""
    x = randn(2, num_blocks, block_size, heads, head_dim, seed=seed)
    x = x * torch.rand(2, num_blocks, block_size, heads, 1,
                       generator=torch.Generator().manual_seed(seed + 1)) * 4
    return quantize_rows(x, fmt)


# -- the format -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_rows_hold_codes_and_their_scale(fmt):
    x = randn(7, 3, 64, scale=5)
    x[2, 1] = 0.0  # an all-zero row: scale 0, codes 0, read back as zeros
    rows = quantize_rows(x, fmt)
    assert rows.dtype == fmt.storage_dtype and rows.shape == (7, 3, 64 + SCALE_BYTES)
    assert format_of(rows) is fmt
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / fmt.qmax, rtol=0, atol=0)
    back = dequantize_rows(rows)
    assert torch.equal(back[2, 1], torch.zeros(64))
    err = (back - x).abs()
    if fmt is INT8:  # half a step of the row's scale
        assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits, relative error <= 2**-4 above the subnormals
        big = x.abs() > scale[..., None] * 2 ** -6
        assert (err[big] <= x.abs()[big] * 2 ** -4 * (1 + 1e-6)).all()
    # the largest value of each row is representable exactly (it maps to +-qmax)
    i = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, i), x.gather(-1, i), rtol=2e-7, atol=0)


# -- C++ CPU kernels ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_ops():
    # The C++ kernels are part of the package (built on first use): a build failure fails these
    # tests rather than skipping them.
    from llmkit.kernels.cpu_native import load_cpu_kernels

    return load_cpu_kernels()


CACHE_KINDS = ["int8", "fp8_e4m3", "bfloat16"]


def empty_cache(kind, num_blocks, block_size, heads, head_dim):
    if kind in FORMATS:
        fmt = FORMATS[kind]
        return torch.zeros(2, num_blocks, block_size, heads, head_dim + SCALE_BYTES,
                           dtype=fmt.storage_dtype)
    return torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=getattr(torch, kind))


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_is_the_reference_bit_for_bit(cpu_ops, kind, dtype):
    heads, head_dim, tokens = 2, 64, 19
    qkv = randn(tokens, 3 * heads, head_dim, scale=3, dtype=dtype)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]  # strided views of a fused output
    slots = torch.randperm(5 * 16, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[[3, 11]] = -1
    cache, expected = empty_cache(kind, 5, 16, heads, head_dim), \
        empty_cache(kind, 5, 16, heads, head_dim)
    cpu_ops.reshape_and_cache(k, v, cache, slots)
    ModelOps().write_kv(k, v, expected, slots)
    assert torch.equal(cache.view(torch.uint8) if kind in FORMATS else cache,
                       expected.view(torch.uint8) if kind in FORMATS else expected)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,group", [(1, 3), (5, 1), (6, 4)])  # per-head and per-group tasks
def test_cpu_decode_attention_reads_the_dequantized_rows(cpu_ops, kind, dtype, batch, group):
    heads_kv, head_dim, block_size = 2, 64, 16
    lens = torch.tensor([1, 37, 16, 70, 5, 33][:batch])
    nb = 6
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:nb]
                         for i in range(batch)]).to(torch.int32)
    if kind in FORMATS:
        cache = quantized_cache(FORMATS[kind], 24, block_size, heads_kv, head_dim)
    else:
        cache = randn(2, 24, block_size, heads_kv, head_dim, dtype=getattr(torch, kind))
    q = randn(batch, heads_kv * group, head_dim, seed=3, dtype=dtype)
    out = cpu_ops.paged_decode_attention(q, cache, table, lens, head_dim ** -0.5)
    ref = ModelOps().paged_decode_attention(q, cache, table, lens, head_dim ** -0.5)
    assert out.dtype == dtype
    tol = F32 if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_cpu_reads_every_code_exactly(cpu_ops, fmt):
    """One context token: the attention output is its V row, so every one of the 256 codes
    (NaN codes aside) must come back as the torch reference's float, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)  # 4 KV heads x 64 values
    cache = torch.zeros(2, 1, 1, 4, 64 + SCALE_BYTES, dtype=torch.uint8)
    cache[1, 0, 0, :, :64] = codes
    cache[1, 0, 0, :, 64:] = torch.full((4, 1), 0.375).view(torch.uint8)  # the rows' scale
    cache = cache.view(fmt.storage_dtype)
    out = cpu_ops.paged_decode_attention(torch.randn(1, 4, 64), cache,
                                         torch.zeros(1, 1, dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32), 0.125)
    expected = dequantize_rows(cache[1, 0, 0])
    keep = ~expected.isnan()
    # equal values (-0.0 comes back +0.0: the weighted sum starts from +0)
    assert torch.equal(out[0][keep], expected[keep])


# -- Triton kernels (interpreted on a CPU) -------------------------------------------------------
@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_triton_write_is_the_reference_bit_for_bit(interpret, fmt):
    from llmkit.kernels.cache import reshape_and_cache, reshape_and_cache_ref

    dev, heads, head_dim, tokens = interpret, 2, 64, 21
    qkv = randn(tokens, 3 * heads, head_dim, scale=3).to(dev)
    qkv[4, heads] = 0.0  # an all-zero K row
    # a row spanning 2**-12 .. 1 of its max: e4m3's subnormals, ties and carries
    sweep = torch.logspace(-12, 0, head_dim, base=2.0) * torch.tensor([1.0, -1.0]).repeat(32)
    qkv[5, 2 * heads] = sweep
    qkv[6, 2 * heads] = torch.arange(head_dim) / 8.0 + 1.0 / 16  # halves: round-half-even
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    slots = torch.randperm(5 * 16, generator=torch.Generator().manual_seed(2))[:tokens]
    slots[[2, 7, 20]] = -1
    slots = slots.to(dev)
    cache = quantized_cache(fmt, 5, 16, heads, head_dim).to(dev)  # old rows stay where skipped
    expected = cache.clone()
    with count_launches() as launches:
        reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_ref(k, v, expected, slots)
    assert launches["_reshape_and_cache_quant_kernel"] == 1
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_attention_reads_the_dequantized_rows(interpret, fmt, num_splits):
    from llmkit.kernels.decode_attention import (paged_decode_attention,
                                                 paged_decode_attention_ref)

    dev, heads_kv, group, head_dim, block_size = interpret, 2, 2, 64, 16
    lens = torch.tensor([1, 37, 32, 70], dtype=torch.int32)
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:5]
                         for i in range(4)]).to(torch.int32)
    cache = quantized_cache(fmt, 24, block_size, heads_kv, head_dim)
    q = randn(4, heads_kv * group, head_dim, seed=3)
    out = paged_decode_attention(q.to(dev), cache.to(dev), table.to(dev), lens.to(dev), 0.125,
                                 num_splits=num_splits, block_n=32)
    ref = paged_decode_attention_ref(q, cache, table, lens, 0.125)
    torch.testing.assert_close(out.cpu(), ref, **F32)
    # and the torch reference is the float kernel over the dequantized pool
    float_out = paged_decode_attention(q.to(dev), dequantize_rows(cache).to(dev), table.to(dev),
                                       lens.to(dev), 0.125, num_splits=num_splits, block_n=32)
    torch.testing.assert_close(out, float_out, **F32)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_triton_unified_attention_reads_the_dequantized_rows(interpret, fmt):
    from llmkit.kernels.unified import unified_attention, unified_attention_ref

    dev, heads_kv, group, head_dim, block_size = interpret, 1, 4, 64, 16
    q_lens, ctx = [1, 19, 11, 3], [40, 0, 21, 16]
    seq_lens = torch.tensor([a + b for a, b in zip(q_lens, ctx)], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 20, 31, 34], dtype=torch.int32)
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:4]
                         for i in range(4)]).to(torch.int32)
    cache = quantized_cache(fmt, 24, block_size, heads_kv, head_dim, seed=5)
    q = randn(34, heads_kv * group, head_dim, seed=6)
    out = unified_attention(q.to(dev), cache.to(dev), qsl.to(dev), seq_lens.to(dev),
                            table.to(dev), 0.125, block_n=32)
    ref = unified_attention_ref(q, cache, qsl, seq_lens, table, 0.125)
    torch.testing.assert_close(out.cpu(), ref, **F32)


# -- engine ---------------------------------------------------------------------------------------
class _FakeQuantTorchBackend(TorchAttentionBackend):
    """The reference: the torch backend over a float pool, K/V written already quantized and
    dequantized -- its attention reads exactly the values a quantized pool's readers see."""

    fmt = INT8

    def forward(self, q, k, v, kv_cache, metadata, scale):
        return super().forward(q, fake_quantize(k, self.fmt), fake_quantize(v, self.fmt),
                               kv_cache, metadata, scale)


class FakeInt8Backend(_FakeQuantTorchBackend):
    fmt = INT8


class FakeFp8Backend(_FakeQuantTorchBackend):
    fmt = FP8_E4M3


REFERENCE = {"int8": "test_kv_cache_quant.FakeInt8Backend",
             "fp8_e4m3": "test_kv_cache_quant.FakeFp8Backend"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 600, (20,), generator=g).tolist()
    # two prompts share a 20-token prefix (prefix-cache hits read quantized blocks)
    return [shared + torch.randint(5, 600, (n,), generator=g).tolist() for n in (9, 3)] + \
        [torch.randint(5, 600, (n,), generator=g).tolist() for n in (1, 33, 12)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_greedy_tokens_equal_the_dequantized_reference(model, cache_dtype):
    prompts = _prompts()
    ref_llm = LLM(str(model), dtype="float32", attention={"_target_": REFERENCE[cache_dtype]},
                  kv_cache={"block_size": 4})
    expected = _tokens(ref_llm, prompts)
    ref_llm.shutdown()
    # C++ kernels (decode rows in place, prefills read back), then torch ops only; chunked
    # prefill over a small budget on the second
    for groups in ({"platform": {"native_kernels": "on"}},
                   {"platform": {"native_kernels": "off"},
                    "scheduler": {"max_num_batched_tokens": 8}}):
        llm = LLM(str(model), dtype="float32", kv_cache={"block_size": 4,
                                                          "cache_dtype": cache_dtype}, **groups)
        runner = llm.engine.executor.runner
        assert runner.kv_caches[0].dtype == FORMATS[cache_dtype].storage_dtype
        assert _tokens(llm, prompts) == expected
        assert llm.engine.kv_cache_manager.prefix_cache_stats.hits > 0
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        llm.shutdown()


def test_triton_engine_with_an_int8_pool_equals_the_reference(model, interpret):
    """attention=triton (interpreted on a CPU): its quantized write and readers, decodes next to
    chunked prefills, give the reference's greedy tokens."""
    prompts = [p[:n] for p, n in zip(_prompts(), (17, 3, 1, 25))]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    groups = dict(kv_cache={"num_blocks": 24, "block_size": 16},
                  scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 4})
    ref = LLM(str(model), dtype="float32", attention={"_target_": REFERENCE["int8"]}, **groups)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    ref.shutdown()
    groups["kv_cache"]["cache_dtype"] = "int8"
    llm = LLM(str(model), dtype="float32", attention="triton", **groups)
    with count_launches() as launches:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert got == expected
    assert {"_reshape_and_cache_quant_kernel", "_paged_decode_kernel",
            "_unified_attention_kernel"} <= set(launches)


def test_a_draft_model_keeps_its_kv_in_the_int8_pool_too(model):
    """speculative=draft_model (the target as its own draft): the draft's layers get int8
    pools of the same blocks, and the greedy tokens are those of the int8 engine alone."""
    prompts = [p[:n] for p, n in zip(_prompts(), (9, 21, 4))]
    kv = {"cache_dtype": "int8", "block_size": 4}
    llm = LLM(str(model), dtype="float32", kv_cache=kv)
    expected = _tokens(llm, prompts)
    llm.shutdown()
    llm = LLM(str(model), dtype="float32", kv_cache=kv, speculative={
        "name": "draft_model", "num_speculative_tokens": 3, "model": str(model)})
    assert all(c.dtype == torch.int8 for c in llm.engine.executor.runner.proposer.kv_caches)
    assert _tokens(llm, prompts) == expected
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    llm.shutdown()


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_ranks_quantize_their_own_kv_heads(model):
    """TP=2 over worker processes: each rank's pool holds its KV head's int8 rows, and the
    greedy tokens are the single-process int8 engine's."""
    prompts = [p[:n] for p, n in zip(_prompts(), (9, 21))]
    kv = {"cache_dtype": "int8", "block_size": 4}
    single = LLM(str(model), dtype="float32", kv_cache=kv)
    expected = _tokens(single, prompts)
    blocks = single.engine.num_blocks
    single.shutdown()
    llm = LLM(str(model), dtype="float32", kv_cache=kv, parallel={"tensor_parallel_size": 2})
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        assert _tokens(llm, prompts) == expected
        assert llm.engine.num_blocks == blocks  # capped by max_num_seqs x max_model_len
    finally:
        llm.shutdown()


@pytest.mark.slow  # compiles (tens of seconds on 2 cores)
def test_step_graphs_read_the_int8_pool_like_eager(model):
    """Decode steps through compiled step graphs (the same C++ ops as graph nodes) give eager's
    tokens and logprobs bit for bit over an int8 pool."""
    from llmkit.compilation.inductor import InductorStepGraphs

    prompts = [p[:n] for p, n in zip(_prompts(), (6, 20, 3))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = {}
    for mode in ("eager", "graphs"):
        llm = LLM(str(model), dtype="float32", compilation={"mode": mode},
                  kv_cache={"cache_dtype": "int8"})
        if mode == "graphs":
            assert isinstance(llm.engine.executor.runner.step_graphs, InductorStepGraphs)
        outs[mode] = [(o.outputs[0].token_ids,
                       [{t: v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs])
                      for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["graphs"] == outs["eager"]


def test_the_pool_holds_more_blocks_in_the_same_memory(model, caplog):
    mem = {"memory_gib": 0.001, "block_size": 4}
    base = LLM(str(model), dtype="float32", kv_cache=mem)
    n_float = base.engine.num_blocks
    base.shutdown()
    head_dim = 16  # the tiny model's
    with caplog.at_level("INFO", logger="llmkit.worker.kv_cache_pool"):
        for name, width in (("int8", head_dim + 4), ("fp8_e4m3", head_dim + 4),
                            ("bfloat16", 2 * head_dim)):
            llm = LLM(str(model), dtype="float32", kv_cache={**mem, "cache_dtype": name})
            # float32 rows are 4 * head_dim bytes; scales counted in the quantized rows
            assert llm.engine.num_blocks == pytest.approx(n_float * 4 * head_dim / width,
                                                          abs=1)
            llm.shutdown()
    assert "KV cache int8" in caplog.text and "3.20x the blocks" in caplog.text


def test_an_offloaded_int8_block_comes_back_with_its_scales(model):
    """The host tier copies whole blocks: a quantized prefix evicted from a small pool and
    loaded back gives the tokens computed from scratch (its scales are inside its rows)."""
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(5, 600, (30,), generator=g).tolist() for _ in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kv = {"block_size": 4, "cache_dtype": "int8"}

    def gen(llm, p):
        return llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids

    big = LLM(str(model), dtype="float32", kv_cache={**kv, "num_blocks": 64})
    expected = gen(big, a)
    big.shutdown()
    llm = LLM(str(model), dtype="float32", kv_cache={**kv, "num_blocks": 12},
              kv_offload={"host_gib": 0.01})
    assert gen(llm, a) == expected
    gen(llm, b)  # evicts a's blocks into the host tier
    assert gen(llm, a) == expected
    assert llm.engine.kv_connector.stats.hits_per_tier.get("host", 0) > 0
    llm.shutdown()


def test_bad_values_are_config_errors(model):
    with pytest.raises(ConfigError, match=r"kv_cache\.cache_dtype.*'int4'.*int8"):
        LLM(str(model), dtype="float32", kv_cache={"cache_dtype": "int4"})
    # a backend that does not declare quantized reads is refused at start-up
    with pytest.raises(ConfigError, match=r"kv_cache\.cache_dtype.*reads auto only"):
        LLM(str(model), dtype="float32", kv_cache={"cache_dtype": "int8"},
            attention={"_target_": "test_kv_cache_quant.PlainBackend"})
    with pytest.raises(ConfigError, match=r"kv_cache\.cache_dtype.*executor=sim"):
        validate_components(compose_config(["executor=sim", "kv_cache.cache_dtype=int8"]))


class PlainBackend(TorchAttentionBackend):
    kv_cache_dtypes = ("auto",)
