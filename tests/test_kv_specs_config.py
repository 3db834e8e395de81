"""llmkit.models.kv_specs: a Hugging Face config -> one KV-cache spec per layer, checked against
the layer kinds transformers' own config classes derive (``layer_types``, Bamba's
``layers_block_type``) and against shapes worked out by hand; a raw config.json dict must give
what the config object gives."""
from __future__ import annotations

import pytest
import torch
import transformers

from llmkit.attention.kv_spec import (FullAttentionSpec, MLASpec, RecurrentStateSpec,
                                      SlidingWindowSpec)
from llmkit.models.kv_specs import (UnknownLayerTypeError, kv_cache_specs_from_hf_config,
                                    llama_kv_specs)

ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "gemma3_text": dict(ATTN, num_hidden_layers=7, head_dim=16, sliding_window=8,
                        sliding_window_pattern=3),
    "gemma2": dict(ATTN, num_hidden_layers=4, head_dim=16, sliding_window=8),
    "qwen2": dict(ATTN, num_hidden_layers=4, sliding_window=8, use_sliding_window=True,
                  max_window_layers=2),
    "mistral": dict(ATTN, num_hidden_layers=2, sliding_window=8),
    "llama": dict(ATTN, num_hidden_layers=3),
    "deepseek_v2": dict(num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8,
                        hidden_size=64, num_attention_heads=4),
    "deepseek_v3": dict(num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8,
                        hidden_size=64, num_attention_heads=4),
    "bamba": dict(ATTN, num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8,
                  mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4),
}


def _hf(model_type: str):
    return transformers.AutoConfig.for_model(model_type, **CASES[model_type])


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_dict_and_config_object_agree(model_type):
    raw = dict(CASES[model_type], model_type=model_type)
    assert kv_cache_specs_from_hf_config(raw) == kv_cache_specs_from_hf_config(_hf(model_type))


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2", "qwen2", "mistral", "llama"])
def test_sliding_layers_follow_transformers_layer_types(model_type):
    cfg = _hf(model_type)
    specs = kv_cache_specs_from_hf_config(cfg)
    # mistral's config keeps no layer_types: its window covers every layer
    kinds = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * len(specs)
    assert [isinstance(s, SlidingWindowSpec) for s in specs] == \
        [k == "sliding_attention" for k in kinds]
    for s in specs:
        assert (s.num_kv_heads, s.head_dim) == (2, 16)
        if isinstance(s, SlidingWindowSpec):
            assert s.sliding_window == 8


def test_gemma3_pattern_by_hand():
    specs = kv_cache_specs_from_hf_config(dict(CASES["gemma3_text"], model_type="gemma3_text"))
    # pattern 3: layers 2 and 5 global
    assert [type(s) for s in specs] == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec,
                                        SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec,
                                        SlidingWindowSpec]
    # the multimodal wrapper reads its text_config
    wrapped = {"model_type": "gemma3", "text_config": dict(CASES["gemma3_text"])}
    assert kv_cache_specs_from_hf_config(wrapped) == specs


def test_qwen2_without_use_sliding_window_is_full():
    raw = dict(CASES["qwen2"], model_type="qwen2", use_sliding_window=False)
    assert kv_cache_specs_from_hf_config(raw) == [FullAttentionSpec(2, 16)] * 4


def test_mla_latent_by_hand():
    specs = kv_cache_specs_from_hf_config(_hf("deepseek_v2"))
    assert specs == [MLASpec(32, 8)] * 2
    assert specs[0].bytes_per_token(torch.bfloat16) == (32 + 8) * 2
    # the latent is whole on every tensor-parallel rank
    assert kv_cache_specs_from_hf_config(_hf("deepseek_v3"), tp_size=2) == specs


def test_bamba_state_by_hand():
    cfg = _hf("bamba")
    specs = kv_cache_specs_from_hf_config(cfg)
    assert [isinstance(s, FullAttentionSpec) for s in specs] == \
        [t == "full_attention" for t in cfg.layers_block_type]
    # d_inner = 2 * 64 = 128, head_dim = 128 / 8 = 16; conv over x, B, C: 128 + 2*2*16
    state = RecurrentStateSpec(((192, 3), (8, 16, 16)), dtype=torch.float32)
    assert specs[0] == state and specs[1] == FullAttentionSpec(2, 16)
    assert state.state_bytes(torch.float32) == (192 * 3 + 8 * 16 * 16) * 4
    assert state.state_bytes(torch.bfloat16) == state.state_bytes(torch.float32)
    # two ranks: half the heads and groups each
    assert kv_cache_specs_from_hf_config(cfg, tp_size=2)[0] == \
        RecurrentStateSpec(((96, 3), (4, 16, 16)), dtype=torch.float32)


def test_tensor_parallel_kv_heads_split_then_replicate():
    raw = dict(CASES["llama"], model_type="llama")
    assert llama_kv_specs(raw, tp_size=2)[0] == FullAttentionSpec(1, 16)
    assert llama_kv_specs(raw, tp_size=4)[0] == FullAttentionSpec(1, 16)


def test_unknown_layer_type_names_it():
    raw = dict(CASES["llama"], model_type="llama", sliding_window=4,
               layer_types=["full_attention", "chunked_attention", "full_attention"])
    with pytest.raises(UnknownLayerTypeError, match=r"layer_types\[1\]='chunked_attention'"):
        kv_cache_specs_from_hf_config(raw)


def test_describe_groups_by_hand():
    from llmkit.models.kv_specs import describe_kv_groups

    specs = kv_cache_specs_from_hf_config(dict(CASES["gemma3_text"], model_type="gemma3_text"))
    per_layer = 2 * 2 * 16 * 2  # K and V, 2 heads of 16, bf16
    assert describe_kv_groups(specs, torch.bfloat16, 16) == [
        f"SlidingWindow(num_kv_heads=2, head_dim=16, sliding_window=8): layers 0-1,3-4,6 (5), "
        f"{5 * per_layer} B/token, {5 * 16 * per_layer} B/block",
        f"FullAttention(num_kv_heads=2, head_dim=16): layers 2,5 (2), {2 * per_layer} B/token, "
        f"{2 * 16 * per_layer} B/block"]


def test_llmkit_config_lists_the_groups(capsys, tmp_path):
    from llmkit.entrypoints import cli

    cfg = transformers.AutoConfig.for_model(
        "gemma3_text", **dict(CASES["gemma3_text"], num_hidden_layers=6, vocab_size=100,
                              intermediate_size=32))
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert cli.main(["config", str(tmp_path), "model.dtype=float32",
                     "kv_cache.block_size=4"]) == 0
    text = capsys.readouterr().out
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert "# KV-cache groups (6 layers, float32, block_size 4, per tensor-parallel rank):\n" \
        f"#   SlidingWindow(num_kv_heads=2, head_dim=16, sliding_window=8): layers 0-1,3-4 (4), " \
        f"{4 * per_layer} B/token, {4 * 4 * per_layer} B/block\n" \
        f"#   FullAttention(num_kv_heads=2, head_dim=16): layers 2,5 (2), {2 * per_layer} " \
        f"B/token, {2 * 4 * per_layer} B/block\n" in text
