"""DeepSeek-V2's MLA, absorbed (one latent row per token) vs expanded (K/V per head,
``model.mla=expanded``), measured through the engine on one small random checkpoint (issue 33):
KV bytes per token and blocks of a fixed pool as the engine allocates them, the largest batch
at a context that pool holds, and decode tokens/s at batch 1 and 32.

    GOMP_SPINCOUNT=1000 python benchmarks/mla_decode_bench.py [--rounds 3] [--threads 2]
        [--prompt-len 128]

Decode tokens/s of a batch of B prompts: ``B * D / (t(1 + D tokens) - t(1 token))``, so the
prompts' prefill is subtracted. The two modes' engines live in one process and are timed
alternately, ``--rounds`` times; the median and the range are printed. On the CPU platform
the absorbed path's decode-only steps run the C++ MLA kernel (``kernels/cpu/mla_attention.h``;
prefill chunks the torch reference), the expanded path the platform's paged attention.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=512, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
             num_hidden_layers=4, max_position_embeddings=2048, topk_method="greedy")


def build_checkpoint(out: Path) -> Path:
    from helpers.tiny_models import build_tokenizer
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = DeepseekV2Config(**SHAPE, vocab_size=len(tokenizer),
                              eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def decode_seconds(llm, batch: int, decode: int, prompt_len: int) -> float:
    from llmkit import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 600 + 5 for j in range(prompt_len)]}
               for i in range(batch)]

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    return run(1 + decode) - run(1)


def main() -> None:
    from llmkit import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--threads", type=int, default=0, help="platform.num_threads (0: all)")
    ap.add_argument("--pool-mib", type=float, default=64.0)
    ap.add_argument("--context", type=int, default=1024, help="for the largest batch")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens before the decode")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_checkpoint(Path(tmp)))
        engines = {}
        for mode in ("absorbed", "expanded"):
            engines[mode] = LLM(path, dtype="float32",
                                platform={"num_threads": args.threads},
                                kv_cache={"memory_gib": args.pool_mib / 1024},
                                # like with like: both eager (the absorbed reference op has
                                # data-dependent branches a step graph cannot capture yet)
                                compilation={"mode": "eager"},
                                overrides=[f"model.mla={mode}"])
        print(f"DeepSeek-V2 random checkpoint: {SHAPE['num_hidden_layers']} layers, "
              f"{SHAPE['num_attention_heads']} heads, qk {SHAPE['qk_nope_head_dim']}+"
              f"{SHAPE['qk_rope_head_dim']}, v {SHAPE['v_head_dim']}, kv_lora_rank "
              f"{SHAPE['kv_lora_rank']}; float32; pool {args.pool_mib:g} MiB; prompts of "
              f"{args.prompt_len}, {args.decode} decode tokens")
        facts = {}
        for mode, llm in engines.items():
            runner = llm.engine.executor.runner
            per_token = runner.kv_cache_bytes_per_block() // runner.block_size
            blocks = llm.engine.kv_cache_manager.num_blocks
            per_request = -(-args.context // runner.block_size)
            facts[mode] = per_token
            print(f"  {mode:9s} KV bytes/token {per_token:7d}  blocks {blocks:6d}  largest batch "
                  f"at {args.context} tokens: {blocks // per_request}")
        print(f"  expanded / absorbed bytes per token: "
              f"{facts['expanded'] / facts['absorbed']:.2f}x")
        for batch in (1, 32):
            times: dict[str, list[float]] = {m: [] for m in engines}
            for mode, llm in engines.items():  # warm-up
                decode_seconds(llm, batch, 2, args.prompt_len)
            for _ in range(args.rounds):
                for mode, llm in engines.items():
                    times[mode].append(decode_seconds(llm, batch, args.decode,
                                                       args.prompt_len))
            rates = {m: [batch * args.decode / t for t in ts] for m, ts in times.items()}
            for mode, rs in rates.items():
                print(f"  batch {batch:2d} {mode:9s} decode tok/s median "
                      f"{statistics.median(rs):8.1f} (range {min(rs):.1f}-{max(rs):.1f}, "
                      f"{args.rounds} rounds)")
            ratios = [a / e for a, e in zip(rates["absorbed"], rates["expanded"])]
            print(f"  batch {batch:2d} absorbed / expanded: median {statistics.median(ratios):.2f}x "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})")
        for llm in engines.values():
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
