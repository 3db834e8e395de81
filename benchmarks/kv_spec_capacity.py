"""What a model's KV-cache specs do to capacity (issue 33): KV bytes per token, bytes one
request holds, and the largest batch that fits a fixed pool, computed from the specs alone
(``llmkit.models.kv_specs`` reads them from the config, ``llmkit.cost_model.kv_footprint``
prices them; no weights), and with ``--engine`` confirmed from a real engine's allocation: a
tiny random checkpoint of each model that llmkit runs, one request prefilled to the context
and one decode step, the blocks the KV cache manager holds for it times the bytes of a block
of the runner's pool.

    python benchmarks/kv_spec_capacity.py [--engine] [--pool-mib 64] [--block-size 16]

Comparisons:

- DeepSeek-V2 (MLA) vs the same model with MLA expanded to per-head K and V, tiny and at
  DeepSeek-V2's own shapes (128 heads, qk 128 + 64, v 128, kv_lora_rank 512);
- Gemma 3 with its 5 local : 1 global windows vs every layer full, at an 8k context;
- Bamba (Mamba-2 hybrid) at 1k vs 8k context (its recurrent layers' bytes stay flat).

Also the decode step the cost model predicts (``llmkit sim``'s) for the full-size shapes on
an H200 profile at batch 32: KV bytes read and the step time, MLA vs expanded.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from llmkit.attention.kv_spec import FullAttentionSpec
from llmkit.cost_model.hardware import load_profile, shipped_profile_path
from llmkit.cost_model.model_shape import ModelShape
from llmkit.cost_model.step_cost import CostModel

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            max_position_embeddings=16384)
TINY = {
    "deepseek_v2": dict(BASE, model_type="deepseek_v2", num_hidden_layers=4,
                        num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1),
    "gemma3_text": dict(BASE, model_type="gemma3_text", num_hidden_layers=12,
                        num_key_value_heads=2, head_dim=16, sliding_window=512,
                        sliding_window_pattern=6),
    "bamba": dict(BASE, model_type="bamba", num_hidden_layers=4, num_key_value_heads=2,
                  attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16,
                  mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2),
}
# the published shapes (config.json fields that matter to the KV cache and the weights)
FULL = {
    "DeepSeek-V2": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=5120,
                        num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, intermediate_size=12288,
                        moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=2,
                        num_experts_per_tok=6, max_position_embeddings=163840),
    "Gemma-3-27B": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=5376,
                        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                        head_dim=128, sliding_window=1024, sliding_window_pattern=6,
                        intermediate_size=21504, max_position_embeddings=131072),
}


def shape(cfg: dict[str, Any], name: str) -> ModelShape:
    return ModelShape.from_hf_config(cfg, name=name)


def expanded(s: ModelShape) -> ModelShape:
    """MLA expanded to per-head K (nope + rope) and V: as bytes, full attention of n_h heads of
    (d_qk + d_v) / 2."""
    d2 = s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim
    assert d2 % 2 == 0
    return dataclasses.replace(s, kv_specs=(FullAttentionSpec(s.num_heads, d2 // 2),)
                               * s.num_layers)


def all_full(s: ModelShape) -> ModelShape:
    """Every layer full attention (the windows dropped)."""
    spec = s.layer_kv_specs[0]
    return dataclasses.replace(s, kv_specs=(FullAttentionSpec(spec.num_kv_heads,
                                                              spec.head_dim),)
                               * s.num_layers)


def row(label: str, s: ModelShape, ctx: int, pool: int, block: int, dtype: str) -> dict:
    f = s.kv_footprint(dtype)
    held = f.held_bytes(ctx, block)
    return {"label": label, "ctx": ctx, "bytes_per_token": f.kv_bytes_per_token,
            "state": f.state_bytes_per_request, "held": held,
            "max_batch": f.max_batch(pool, ctx, block)}


def print_rows(title: str, rows: list[dict], pool: int) -> None:
    print(f"\n{title} (pool {pool / 2**20:.0f} MiB)")
    print(f"  {'variant':34s} {'context':>7s} {'KV B/token':>11s} {'state B/req':>11s} "
          f"{'held B/req':>12s} {'max batch':>9s}")
    for r in rows:
        print(f"  {r['label']:34s} {r['ctx']:7d} {r['bytes_per_token']:11.0f} "
              f"{r['state']:11.0f} {r['held']:12.0f} {r['max_batch']:9d}")


def config_only(pool: int, block: int, dtype: str) -> None:
    ds = shape(TINY["deepseek_v2"], "tiny DeepSeek-V2")
    rows = [row("tiny DeepSeek-V2, MLA latent", ds, 1024, pool, block, dtype),
            row("same, MLA expanded to per-head K/V", expanded(ds), 1024, pool, block, dtype),
            row("same, model.mla=expanded (V padded)", ds.with_mla("expanded"), 1024, pool,
                block, dtype)]
    print_rows("MLA vs expanded (tiny: 4 heads, qk 16+8, v 16, kv_lora_rank 32)", rows, pool)
    tiny_ratio = rows[1]["bytes_per_token"] / rows[0]["bytes_per_token"]
    print(f"  ratio {tiny_ratio:.2f}x bytes/token: 4 x (24 + 16) = 160 vs 32 + 8 = 40 values "
          "per token per layer")
    big = shape(FULL["DeepSeek-V2"], "DeepSeek-V2")
    big_pool = 40 * 2**30
    rows = [row("DeepSeek-V2, MLA latent", big, 4096, big_pool, block, dtype),
            row("same, expanded to per-head K/V", expanded(big), 4096, big_pool, block, dtype),
            row("same, model.mla=expanded (V padded)", big.with_mla("expanded"), 4096,
                big_pool, block, dtype)]
    print_rows("DeepSeek-V2's own shapes (60 layers)", rows, big_pool)
    print(f"  ratio {rows[1]['bytes_per_token'] / rows[0]['bytes_per_token']:.1f}x: "
          f"128 x (192 + 128) = 40,960 vs 512 + 64 = 576 values per token per layer")

    g = shape(TINY["gemma3_text"], "tiny Gemma 3")
    rows = [row("tiny Gemma 3, window 512 (5:1)", g, 8192, pool, block, dtype),
            row("same, every layer full", all_full(g), 8192, pool, block, dtype)]
    print_rows("Gemma 3 window vs all full at 8k (tiny: 12 layers, 2 KV heads of 16)", rows,
               pool)
    print(f"  max batch ratio {rows[0]['max_batch'] / max(rows[1]['max_batch'], 1):.2f}x")
    g27 = shape(FULL["Gemma-3-27B"], "Gemma-3-27B")
    rows = [row("Gemma-3-27B, window 1024 (5:1)", g27, 8192, big_pool, block, dtype),
            row("same, every layer full", all_full(g27), 8192, big_pool, block, dtype)]
    print_rows("Gemma-3-27B's own shapes at 8k", rows, big_pool)
    print(f"  max batch ratio {rows[0]['max_batch'] / max(rows[1]['max_batch'], 1):.2f}x")

    b = shape(TINY["bamba"], "tiny Bamba")
    rows = [row("tiny Bamba (1 attention : 3 Mamba-2)", b, ctx, pool, block, dtype)
            for ctx in (1024, 8192)]
    print_rows("Bamba at 1k vs 8k context (tiny: Mamba-2 state float32)", rows, pool)
    f = b.kv_footprint(dtype)
    for ctx in (1024, 8192):
        parts = ", ".join(f"{g.spec.__class__.__name__.removesuffix('Spec')} "
                          f"{g.held_bytes(ctx, block):.0f} B" for g in f.groups)
        print(f"  {ctx:5d} tokens: {parts}")

    hw = load_profile(shipped_profile_path("h200"))
    print("\npredicted decode step, batch 32 at 4096 tokens, h200 profile, bf16, per device "
          "(llmkit sim's cost model; DeepSeek-V2 on 8 devices: the latent is whole on every "
          "rank, expanded heads split 16 per rank)")
    for label, s, tp in (("DeepSeek-V2 MLA, TP=8", big, 8),
                         ("DeepSeek-V2 expanded, TP=8", expanded(big), 8),
                         ("Gemma-3-27B windows", g27, 1), ("Gemma-3-27B all full", all_full(g27), 1)):
        cm = CostModel(s, hw, "bfloat16", tensor_parallel_size=tp)
        c = cm.decode_step(32, 4096)
        kv = 32 * cm.kv.decode_bytes(4096)
        print(f"  {label:27s} KV read {kv / 2**30:6.2f} GiB of {c.bytes / 2**30:6.2f} GiB, "
              f"step {c.total_s * 1e3:7.2f} ms ({c.bound}-bound)")


def engine_check(block_size: int, pool: int, dtype: str) -> None:
    """Blocks a real engine holds for one request, against the specs' arithmetic."""
    import tempfile
    from pathlib import Path

    import torch
    import transformers
    from helpers.tiny_models import build_tokenizer

    from llmkit import LLM
    from llmkit.models.registry import MODELS
    from llmkit.request import Request
    from llmkit.sampling.params import SamplingParams

    tok = build_tokenizer()
    # "<model_type>/<variant>": expanded = model.mla=expanded; full = every layer full
    # attention (the same tiny Gemma 3 with layer_types all "full_attention")
    runs = [("deepseek_v2", "DeepseekV2ForCausalLM", 1024),
            ("deepseek_v2/expanded", "DeepseekV2ForCausalLM", 1024), ("gemma3_text",
             "Gemma3ForCausalLM", 8192), ("gemma3_text/full", "Gemma3ForCausalLM", 8192),
            ("bamba", "BambaForCausalLM", 1024), ("bamba", "BambaForCausalLM", 8192)]
    print(f"\nreal engine (tiny random checkpoints, {dtype}, kv_cache.block_size {block_size}; "
          f"pool {pool / 2**20:.0f} MiB): blocks held by one request after its prefill and "
          "one decode step")
    print(f"  {'model':20s} {'context':>7s} {'block':>5s} {'B/block':>8s} {'blocks':>6s} "
          f"{'engine B/req':>12s} {'specs B/req':>12s} {'engine max batch':>16s}")
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[str, Path] = {}
        for label, arch, ctx in runs:
            model_type, _, variant = label.partition("/")
            mla = "expanded" if variant == "expanded" else "absorbed"
            if arch not in MODELS:
                print(f"  {label:20s} {ctx:7d}  (no {arch} in llmkit yet)")
                continue
            kw = {k: v for k, v in TINY[model_type].items() if k != "model_type"}
            if variant == "full":
                kw = dict(kw, layer_types=["full_attention"] * kw["num_hidden_layers"])
            key = model_type + ("/full" if variant == "full" else "")
            if key not in built:
                cfg = transformers.AutoConfig.for_model(
                    model_type, **dict(kw, vocab_size=len(tok),
                                       bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id))
                cfg.architectures = [arch]
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(cfg)
                built[key] = Path(tmp) / key.replace("/", "-")
                model.save_pretrained(built[key])
                tok.save_pretrained(built[key])
            llm = LLM(str(built[key]), dtype=dtype, overrides=[f"model.mla={mla}"],
                      kv_cache={"num_blocks": 4 + 2 * -(-(ctx + 1) // block_size) * 8,
                                "block_size": block_size},
                      scheduler={"max_num_batched_tokens": ctx + 16, "max_num_seqs": 4})
            core = llm.engine
            core.add_request(Request("a", [7 + i % 500 for i in range(ctx)],
                                     SamplingParams(max_tokens=4, ignore_eos=True)))
            while core.scheduler.get_request("a").num_computed_tokens <= ctx:
                core.step()  # the prefill, then one decode step
            held = core.kv_cache_manager.num_blocks_held("a")
            per_block = core.executor.kv_cache_bytes_per_block()
            bs = core.kv_cache_manager.block_size
            engine_bytes = held * per_block
            s = shape(TINY[model_type], model_type).with_mla(mla)
            specs = (all_full(s) if variant == "full" else s).kv_footprint(dtype)
            # the hybrid manager keeps one null block out of the pool
            null = 1 if core.kv_cache_manager.__class__.__name__.startswith("Hybrid") else 0
            fits = (pool // per_block - null) // held
            print(f"  {label:20s} {ctx:7d} {bs:5d} {per_block:8d} {held:6d} "
                  f"{engine_bytes:12d} {specs.held_bytes(ctx + 1, bs):12.0f} {fits:16d}")
            while core.has_unfinished_requests():
                core.step()
            core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-mib", type=float, default=64.0,
                    help="the fixed pool the tiny models' batches must fit (MiB)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--engine", action="store_true",
                    help="also count the blocks a real engine holds (tiny random checkpoints)")
    args = ap.parse_args()
    pool = int(args.pool_mib * 2**20)
    print(f"KV dtype {args.dtype}, block_size {args.block_size}; held = whole blocks per "
          "group (a window's group keeps ceil((W-1)/B)+1 blocks, a state one block)")
    config_only(pool, args.block_size, args.dtype)
    if args.engine:
        engine_check(args.block_size, pool, args.dtype)


if __name__ == "__main__":
    main()
