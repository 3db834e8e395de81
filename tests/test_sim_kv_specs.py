"""The simulator prices each KV-cache spec: MLA's latent row, a sliding window's bound and a
recurrent layer's fixed state change how many requests fit a pool and the KV bytes a decode
step reads (its TPOT). Every figure is worked out by hand from the tiny configs below."""
from __future__ import annotations

import dataclasses
import json

import pytest

from llmkit.attention.kv_spec import FullAttentionSpec
from llmkit.cost_model.hardware import HardwareProfile, load_profile_yaml
from llmkit.cost_model.kv_footprint import _pairs
from llmkit.cost_model.model_shape import ModelShape, dtype_bytes
from llmkit.cost_model.step_cost import CostModel, SeqWork

from helpers.sim_config import cfg_of
from test_sim_cost_model import HW_DIR

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            max_position_embeddings=4096)
DEEPSEEK = dict(BASE, model_type="deepseek_v2", num_hidden_layers=2, num_key_value_heads=4,
                kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                q_lora_rank=None)
GEMMA2 = dict(BASE, model_type="gemma2", num_hidden_layers=4, num_key_value_heads=2,
              head_dim=16, sliding_window=8)
BAMBA = dict(BASE, model_type="bamba", num_hidden_layers=4, num_key_value_heads=2,
             attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
             mamba_d_conv=4, mamba_expand=2)


@pytest.fixture(scope="module")
def h200() -> HardwareProfile:
    return HardwareProfile.from_config(load_profile_yaml(HW_DIR / "h200.yaml"))


def _expanded(shape: ModelShape) -> ModelShape:
    """The same DeepSeek with MLA expanded to per-head K (nope + rope) and V: as bytes, a full
    attention layer of n_h heads of (d_qk + d_v) / 2."""
    d = (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim) // 2
    return dataclasses.replace(shape, kv_specs=(FullAttentionSpec(shape.num_heads, d),)
                               * shape.num_layers)


def test_pairs_closed_form_matches_counting():
    for c in range(1, 30):
        for q in range(1, c + 1):
            for w in (None, 1, 3, 8, 40):
                counted = sum(min(p + 1, w or 10**9) for p in range(c - q, c))
                assert _pairs(q, c, w) == counted, (q, c, w)


def test_mla_latent_capacity_and_decode_bytes(h200):
    mla = ModelShape.from_hf_config(DEEPSEEK)
    exp = _expanded(mla)
    # bf16: 2 layers x (32 + 8) latent values x 2 B = 160 B/token; expanded: 2 layers x 4 heads
    # x (24 + 16) x 2 B = 640 B/token
    assert mla.kv_bytes_per_token("bfloat16") == 2 * 40 * 2 == 160
    assert exp.kv_bytes_per_token("bfloat16") == 2 * 4 * (24 + 16) * 2 == 640
    fm, fe = mla.kv_footprint("bfloat16"), exp.kv_footprint("bfloat16")
    pool = 1_000_000
    assert fm.max_batch(pool, 1000) == pool // (1000 * 160) == 6
    assert fe.max_batch(pool, 1000) == pool // (1000 * 640) == 1
    # whole blocks of 16: a 1000-token request holds 63 blocks per layer
    assert fm.held_bytes(1000, block_size=16) == 2 * 63 * 16 * 80
    # decode: 4 requests, 100 more tokens of context each read 4 x 100 x 160 B more; same
    # weights, so the step's bytes differ by exactly that
    for shape, kappa in ((mla, 160), (exp, 640)):
        cm = CostModel(shape, h200, "bfloat16")
        grown = cm.decode_step(4, 201).bytes - cm.decode_step(4, 101).bytes
        assert grown == pytest.approx(4 * 100 * kappa)
    cm_m, cm_e = CostModel(mla, h200, "bfloat16"), CostModel(exp, h200, "bfloat16")
    assert cm_m.decode_step(32, 2048).memory_s < cm_e.decode_step(32, 2048).memory_s
    # the latent is whole on every rank; expanded heads split over them
    assert CostModel(mla, h200, "bfloat16").kv_bytes_per_token == 160


def test_mla_params_counted_by_hand():
    s = ModelShape.from_hf_config(DEEPSEEK)
    h, n, r, rope, nope, v = 64, 4, 32, 8, 16, 16
    attn = h * n * (nope + rope) + h * (r + rope) + r + r * n * (nope + v) + n * v * h
    assert s.attn_params_per_layer == attn
    s2 = ModelShape.from_hf_config(dict(DEEPSEEK, q_lora_rank=24))
    assert s2.attn_params_per_layer == attn - h * n * (nope + rope) + h * 24 + 24 \
        + 24 * n * (nope + rope)


def test_deepseek_v2_own_shapes_576_vs_40960_values():
    cfg = dict(BASE, model_type="deepseek_v2", num_hidden_layers=60, num_attention_heads=128,
               num_key_value_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, hidden_size=5120)
    s = ModelShape.from_hf_config(cfg)
    assert s.kv_bytes_per_token("bfloat16") == 60 * 576 * 2
    assert _expanded(s).kv_bytes_per_token("bfloat16") == 60 * 128 * (192 + 128) * 2
    assert 40960 / 576 == pytest.approx(71.1, abs=0.05)


def test_sliding_window_bounds_what_a_request_holds_and_reads(h200):
    s = ModelShape.from_hf_config(GEMMA2)  # layers 0, 2 slide (window 8), 1, 3 full
    f = s.kv_footprint("float32")
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert f.kv_bytes_per_token == 4 * per_layer
    assert f.held_bytes(100) == 2 * 100 * per_layer + 2 * 8 * per_layer
    assert f.held_bytes(5) == 4 * 5 * per_layer  # inside the window every layer grows
    # blocks of 4: full 25 blocks, sliding ceil(7 / 4) + 1 = 3 blocks
    assert f.held_bytes(100, block_size=4) == 2 * 25 * 4 * per_layer + 2 * 3 * 4 * per_layer
    pool = 10 * 1024 * 1024
    assert f.max_batch(pool, 8192) == pool // (2 * 8192 * per_layer + 2 * 8 * per_layer)
    all_full = dataclasses.replace(s, kv_specs=(FullAttentionSpec(2, 16),) * 4)
    assert all_full.kv_footprint("float32").max_batch(pool, 8192) == \
        pool // (4 * 8192 * per_layer)
    # a decode step reads the whole context in full layers, the window in sliding ones
    assert f.decode_bytes(100) == 2 * 101 * per_layer + 2 * (8 + 1) * per_layer
    cm = CostModel(s, h200, "float32")
    grown = cm.decode_step(3, 200).bytes - cm.decode_step(3, 100).bytes
    assert grown == pytest.approx(3 * 100 * 2 * per_layer)  # the full layers only
    # attention FLOPs: a prefill of 20 tokens, pairs 210 in full layers, 8*8... in sliding ones
    c = cm.step([SeqWork(20, 20, True)])
    c_full = CostModel(all_full, h200, "float32").step([SeqWork(20, 20, True)])
    windowed = 36 + (20 - 8) * 8  # 1+2+...+8, then 8 per query
    assert c_full.flops - c.flops == pytest.approx(2 * 4 * 4 * 16 * (210 - windowed))


def test_recurrent_state_is_flat_in_the_context(h200):
    s = ModelShape.from_hf_config(BAMBA)  # layer 1 attends, 0, 2, 3 keep a Mamba-2 state
    f = s.kv_footprint("bfloat16")
    # conv [128 + 2*2*16, 3] + ssm [8 heads, 16, 16], float32 whatever the model's dtype
    state = (192 * 3 + 8 * 16 * 16) * 4
    attn = 2 * 2 * 16 * 2
    assert f.state_bytes_per_request == 3 * state
    assert f.kv_bytes_per_token == attn
    assert f.held_bytes(1024) == 3 * state + 1024 * attn
    assert f.held_bytes(8192) - f.held_bytes(1024) == (8192 - 1024) * attn
    # whole blocks: the state is one block per request per layer
    assert f.held_bytes(1024, block_size=16) == 3 * state + 64 * 16 * attn
    cm = CostModel(s, h200, "bfloat16")
    one, two = cm.decode_step(1, 100).bytes, cm.decode_step(2, 100).bytes
    # one more request: its weights are shared; its state read and written, its context read
    # (and written), its token's embedding row gathered
    assert two - one == pytest.approx(3 * 2 * state + 101 * attn + 64 * 2)


def _sim_core(tmp_path, cfg: dict, *overrides: str):
    from llmkit.tools.sim.replay import build_sim_engine

    path = tmp_path / cfg["model_type"] / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(cfg, architectures=["X"])))
    return build_sim_engine(cfg_of(f"sim.model={path}", "hardware=h200", *overrides))


def _prefill_alone(core, prompt_len: int) -> str:
    from llmkit.request import Request
    from llmkit.sampling.params import SamplingParams

    core.add_request(Request("a", list(range(10, 10 + prompt_len)),
                             SamplingParams(max_tokens=8, ignore_eos=True)))
    while core.scheduler.get_request("a").num_computed_tokens < prompt_len:
        core.step()
    return "a"


def test_sim_engine_runs_the_engines_manager_on_the_runners_pool_layout(tmp_path):
    from llmkit.kv_cache.hybrid import HybridKVCacheManager

    # MLA alone: one group, the plain manager; a block is 16 latent rows of both layers
    core, ex, _ = _sim_core(tmp_path, DEEPSEEK, "kv_cache.num_blocks=64")
    assert not isinstance(core.kv_cache_manager, HybridKVCacheManager)
    assert ex.kv_cache_bytes_per_block() == 16 * 160
    # Bamba: 3 recurrent groups + 1 full; the float32 SSM state [8, 16, 16] (8192 B) fills the
    # K half of a page, so attention blocks grow to 8192 / (2 heads x 16 x 2 B) = 128 tokens
    core, ex, _ = _sim_core(tmp_path, BAMBA, "kv_cache.num_blocks=64")
    kv = core.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.num_groups == 4
    assert ex.block_size == 128 and ex.kv_cache_bytes_per_block() == 2 * 64 * 128
    rid = _prefill_alone(core, 200)
    assert kv.num_blocks_held(rid) == 3 + 2  # a state block per Mamba layer, 201 tokens
    # Gemma 2, window 8 of blocks of 4: the sliding group keeps ceil(7 / 4) + 1 = 2 blocks
    core, ex, _ = _sim_core(tmp_path, GEMMA2, "kv_cache.num_blocks=200",
                            "kv_cache.block_size=4")
    kv = core.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert ex.kv_cache_bytes_per_block() == 2 * 4 * (2 * 2 * 16 * 2)  # 2 layers a group, bf16
    rid = _prefill_alone(core, 100)
    # the prefill step held the window's group for all 100 tokens; at the next step (101
    # tokens: 26 blocks) the blocks wholly before position 100 - 8 + 1 go: (100 - 7) // 4 = 23
    assert kv.num_blocks_held(rid) == 25 + 25  # 100 tokens in blocks of 4, both groups
    core.step()
    assert kv.num_blocks_held(rid) == 26 + 3
    usage = core.stats().kv_usage_by_group
    assert set(usage) == {"0:sliding_window(8)", "1:full"}
    assert usage["0:sliding_window(8)"] < usage["1:full"]


def test_sim_prices_model_mla_expanded_as_the_engine_keeps_it(tmp_path):
    from llmkit.models.kv_specs import kv_cache_specs_from_hf_config

    core, ex, _ = _sim_core(tmp_path, DEEPSEEK, "kv_cache.num_blocks=64", "model.mla=expanded")
    # K and V per head, V padded to K's width (16 + 8): 2 layers x 2 x 4 heads x 24 x 2 B
    assert ex.cost_model.kv_bytes_per_token == 2 * 2 * 4 * 24 * 2
    assert list(ex.model.shape.layer_kv_specs) == kv_cache_specs_from_hf_config(
        DEEPSEEK, mla="expanded")
    assert ex.kv_cache_bytes_per_block() == 16 * 2 * 2 * 4 * 24 * 2
