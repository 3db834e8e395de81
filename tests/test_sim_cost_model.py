"""The simulator's cost model against the seed's figures (each within ±10%), with the shipped
hardware profiles as they are — no efficiency is set or changed by any test."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmkit.cost_model.hardware import HardwareProfile, load_profile_yaml
from llmkit.cost_model.model_shape import ModelShape, load_shape, shape_names
from llmkit.cost_model.step_cost import CostModel, SeqWork

REPO = Path(__file__).resolve().parents[1]
HW_DIR = REPO / "conf" / "tools" / "hardware"
PROFILES = ("a100-80gb", "h100-sxm", "h200", "l4", "cpu-local")


def within(value: float, lo: float, hi: float | None = None, tol: float = 0.10) -> bool:
    """``value`` in ``[lo, hi]`` widened by ``tol`` (a single figure: hi = lo)."""
    hi = lo if hi is None else hi
    return lo * (1 - tol) <= value <= hi * (1 + tol)


def profile(name: str) -> HardwareProfile:
    return HardwareProfile.from_config(load_profile_yaml(HW_DIR / f"{name}.yaml"))


@pytest.fixture(scope="module")
def llama7b_a100() -> CostModel:
    return CostModel(load_shape("llama-2-7b"), profile("a100-80gb"), "float16")


# --------------------------------------------------------------------------- model shape

def test_llama2_7b_shape_from_its_published_config():
    s = load_shape("llama-2-7b")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size,
            s.vocab_size) == (4096, 32, 32, 32, 11008, 32000)
    assert s.num_params == 6_738_415_616  # the published 6.7 B (HF reports 6,738,415,616)
    assert within(s.weight_bytes("float16") / 1e9, 13.5)  # seed: 13.5 GB of weights
    assert s.kv_bytes_per_token("float16") == 2 * 32 * 32 * 128 * 2  # 0.5 MiB per token
    assert s.checkpoint_dtype == "float16" and s.eos_token_ids == (2,)


def test_gqa_moe_and_gpt2_shapes():
    l3 = load_shape("llama-3-8b")
    assert within(l3.num_params / 1e9, 8.03, tol=0.01)
    assert l3.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2
    assert l3.kv_bytes_per_token("bfloat16", tp=16) == 2 * 32 * 1 * 128 * 2  # replicated
    assert within(load_shape("llama-2-70b").num_params / 1e9, 68.98, tol=0.01)
    gpt2 = ModelShape.from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12,
                                      "n_head": 12, "vocab_size": 50257, "n_positions": 1024})
    assert gpt2.tie_word_embeddings and not gpt2.gated_mlp
    assert gpt2.intermediate_size == 3072 and gpt2.max_position_embeddings == 1024
    moe = ModelShape.from_hf_config({"model_type": "mixtral", "hidden_size": 4096,
                                     "num_hidden_layers": 32, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "intermediate_size": 14336,
                                     "vocab_size": 32000, "num_local_experts": 8,
                                     "num_experts_per_tok": 2})
    assert within(moe.num_params / 1e9, 46.7, tol=0.01)  # Mixtral-8x7B
    # one token reads 2 of 8 experts; a big batch reads them all
    assert moe.layer_params_read(1) < 0.4 * moe.layer_params
    assert moe.layer_params_read(256) == pytest.approx(moe.layer_params, rel=1e-6)
    assert set(shape_names()) >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b"}


# --------------------------------------------------------------------------- the seed's figures

def test_seed_weight_read_7b_a100(llama7b_a100):
    # seed ch. 14: 13.5 GB / 2.0 TB/s ≈ 6.6 ms (6.6–6.75 ms), at the peak bandwidth
    t = llama7b_a100.weight_read_time_s(at_peak=True)
    assert within(t * 1e3, 6.6, 6.75), t


@pytest.mark.parametrize("ctx", [128, 512, 2048])
def test_seed_decode_batch1_8_to_12_ms(llama7b_a100, ctx):
    t = llama7b_a100.decode_step(1, ctx).total_s
    assert within(t * 1e3, 8, 12), (ctx, t)


@pytest.mark.parametrize("ctx", [128, 256, 512])
def test_seed_decode_batch32_10_to_18_ms(llama7b_a100, ctx):
    t = llama7b_a100.decode_step(32, ctx).total_s
    assert within(t * 1e3, 10, 18), (ctx, t)


def test_seed_throughput_100_to_2000_tokens_per_s(llama7b_a100):
    # seed: batch 1 → 32 takes decode throughput from about 100 to about 2000 tokens/s
    # (contexts of 512 tokens: a chat turn's prompt plus its answer so far)
    b1 = 1 / llama7b_a100.decode_step(1, 512).total_s
    b32 = 32 / llama7b_a100.decode_step(32, 512).total_s
    assert within(b1, 100), b1
    assert within(b32, 2000), b32


def test_seed_decode_is_memory_bound_with_low_mfu(llama7b_a100):
    # seed: "decode MFU is only a few points"
    for b in (1, 32):
        c = llama7b_a100.decode_step(b, 512)
        assert c.bound == "memory"
        mfu = c.flops / c.total_s / llama7b_a100.peak_flops
        assert mfu < 0.12, (b, mfu)
    assert llama7b_a100.prefill_step([2048]).bound == "compute"


# --------------------------------------------------------------------------- the equations

def test_step_cost_equations(llama7b_a100):
    cm = llama7b_a100
    s, hw = cm.shape, cm.hw
    c = cm.step([SeqWork(100, 300, True), SeqWork(1, 50, True), SeqWork(20, 20, False)])
    T, S = 121, 2
    pairs = 100 * 200 + 100 * 101 / 2 + 1 * 49 + 1 + 20 * 21 / 2
    flops = (2 * T * s.num_layers * s.layer_params + 2 * S * s.vocab_size * s.hidden_size
             + 4 * s.num_layers * s.num_heads * s.head_dim * pairs)
    assert c.flops == pytest.approx(flops)
    kv = (300 + 100 + 50 + 1 + 20 + 20) * s.kv_bytes_per_token("float16")
    weights = (s.num_layers * s.layer_params + s.lm_head_params + T * s.hidden_size) * 2
    assert c.bytes == pytest.approx(weights + kv)
    assert c.compute_s == pytest.approx(flops / (hw.peak("float16") * hw.compute_efficiency))
    assert c.memory_s == pytest.approx((weights + kv) / (hw.memory_bandwidth
                                                        * hw.memory_efficiency))
    assert c.overhead_s == pytest.approx(hw.step_overhead_s + 32 * hw.layer_overhead_s)
    assert c.total_s == pytest.approx(max(c.compute_s, c.memory_s) + c.overhead_s)
    assert c.comm_s == 0 and (c.num_tokens, c.num_seqs) == (T, 3)
    assert cm.step([]).total_s == 0


def test_cpu_terms_per_request_token_and_context_add_to_the_overhead():
    """seq/token/context overheads (fitted on a CPU by `sim calibrate engine`) add n·t_seq +
    T·t_token + Σc·t_context; every GPU profile leaves them at 0."""
    shape = load_shape("llama-2-7b")
    hw = profile("cpu-local")
    terms = HardwareProfile(**{**hw.as_dict(), "seq_overhead_s": 1e-3, "token_overhead_s": 2e-5,
                               "context_overhead_s": 3e-8})
    plain, cpu = CostModel(shape, hw, "float32"), CostModel(shape, terms, "float32")
    work = [SeqWork(100, 300, True), SeqWork(1, 50, True), SeqWork(20, 20, False)]
    a, b = plain.step(work), cpu.step(work)
    assert b.overhead_s - a.overhead_s == pytest.approx(3 * 1e-3 + 121 * 2e-5 + 370 * 3e-8)
    assert (b.compute_s, b.memory_s) == (a.compute_s, a.memory_s)
    assert cpu.describe()["seq_overhead_s"] == 1e-3
    for name in PROFILES:
        p = profile(name)
        assert p.seq_overhead_s == p.token_overhead_s == p.context_overhead_s == 0


def test_frontend_token_cost_stretches_steps_with_the_streaming_rate():
    """A front end taking c seconds of the engine's CPU per token streamed, at R tokens/s,
    makes each step 1 / (1 - c·R) as long (added to the overhead); every GPU profile has c 0."""
    shape = load_shape("llama-2-7b")
    hw = profile("cpu-local")
    shared = HardwareProfile(**{**hw.as_dict(), "frontend_token_s": 2e-3})
    plain, cpu = CostModel(shape, hw, "float32"), CostModel(shape, shared, "float32")
    for work in ([SeqWork(1, 300, True)] * 8, [SeqWork(512, 512, True), SeqWork(1, 40, True)]):
        a = plain.step(work, stream_rate=100.0)
        assert cpu.step(work).total_s == pytest.approx(a.total_s)  # nothing streamed
        b = cpu.step(work, stream_rate=100.0)  # a share of 0.2
        assert b.total_s == pytest.approx(a.total_s / 0.8)
        assert (b.compute_s, b.memory_s) == (a.compute_s, a.memory_s)
        assert cpu.step(work, stream_rate=1e6).total_s == pytest.approx(a.total_s / 0.1)
    assert cpu.describe()["frontend_token_s"] == 2e-3
    for name in PROFILES:
        assert profile(name).frontend_token_s == 0


def test_stream_rate_is_a_decayed_token_count():
    import math

    from llmkit.tools.sim.frontend_cost import StreamRate

    r = StreamRate(tau_s=1.0)
    assert r.at(5.0) == 0.0
    for i in range(200):  # 50 tokens/s for 4 s: the rate converges to 50
        r.add(i * 0.02, 1)
    assert r.at(3.98) == pytest.approx(50, rel=0.03)
    assert r.at(4.98) == pytest.approx(r.at(3.98) * math.exp(-1))  # then it decays


def test_tensor_parallel_adds_all_reduce_and_does_not_halve_latency():
    shape, hw = load_shape("llama-2-70b"), profile("h100-sxm")
    tp2, tp4 = CostModel(shape, hw, "bfloat16", 2), CostModel(shape, hw, "bfloat16", 4)
    a, b = tp2.decode_step(1, 1024), tp4.decode_step(1, 1024)
    assert a.comm_s > 0 and b.comm_s > a.comm_s * 0.9
    # per all-reduce: latency + 2(p-1)/p · T·h·bytes / (link · η)
    one = hw.link_latency_s + 2 * 3 / 4 * 8192 * 2 / (hw.link_bandwidth * hw.link_efficiency)
    assert b.comm_s == pytest.approx(2 * 80 * one)
    assert b.total_s > 0.5 * a.total_s  # seed ch. 08: all-reduce sits on the critical path
    assert b.memory_s == pytest.approx(a.memory_s / 2, rel=0.05)
    with pytest.raises(ValueError, match="no link"):
        CostModel(shape, HardwareProfile(name="x", peak_flops={"bfloat16": 1e12},
                                         memory_bytes=1e9, memory_bandwidth=1e9,
                                         compute_efficiency=1, memory_efficiency=1),
                  "bfloat16", 2)


def test_fp8_halves_weight_bytes_and_uses_fp8_peak():
    shape, hw = load_shape("llama-3-8b"), profile("h100-sxm")
    bf, f8 = CostModel(shape, hw, "bfloat16"), CostModel(shape, hw, "fp8")
    assert f8.weight_bytes * 2 == bf.weight_bytes
    assert f8.peak_flops == pytest.approx(2 * bf.peak_flops, rel=1e-3)
    assert f8.kv_dtype == "bfloat16"
    assert f8.decode_step(1, 512).memory_s < 0.6 * bf.decode_step(1, 512).memory_s


def test_faster_memory_is_faster_decode_in_profile_order():
    shape = load_shape("llama-2-7b")
    t = {n: CostModel(shape, profile(n), "bfloat16").decode_step(8, 512).total_s
         for n in ("l4", "a100-80gb", "h100-sxm", "h200")}
    assert t["l4"] > t["a100-80gb"] > t["h100-sxm"] > t["h200"]


# --------------------------------------------------------------------------- the profiles

SOURCED_KEYS = ("memory_gb", "memory_bandwidth_gbs", "link_bandwidth_gbs", "link_latency_us",
                "compute", "memory", "link", "step_overhead_ms", "layer_overhead_us",
                "seq_overhead_us", "token_overhead_us", "context_overhead_ns")


@pytest.mark.parametrize("name", PROFILES)
def test_profile_validates_and_every_value_names_its_source(name):
    from llmkit.tools.schema import HardwareConfig

    path = HW_DIR / f"{name}.yaml"
    cfg = HardwareConfig.model_validate(load_profile_yaml(path))
    assert cfg.name == name
    lines = path.read_text().splitlines()
    # a value is sourced by a comment on its line or in the comment block right above it
    for i, line in enumerate(lines):
        m = re.match(r"\s*([a-z_0-9]+):\s*(\S.*)?$", line)
        if not m or not m.group(2) or m.group(1) not in SOURCED_KEYS + tuple(cfg.peak_tflops):
            continue
        j, has = i, "#" in line
        while not has and j > 0 and lines[j - 1].lstrip().startswith("#"):
            has, j = True, j - 1
        assert has, f"{path.name}:{i + 1}: {line.strip()!r} has no source comment"


def test_efficiencies_live_only_in_the_profiles():
    """No config key besides a hardware profile can set an efficiency (so no test or run can
    tune one): SimConfig has no such field."""
    from llmkit.tools.schema import SimConfig

    assert not [f for f in SimConfig.model_fields if "eff" in f or "overhead" in f]
    for name in PROFILES:
        hw = profile(name)
        assert 0 < hw.compute_efficiency <= 1 and 0 < hw.memory_efficiency <= 1
