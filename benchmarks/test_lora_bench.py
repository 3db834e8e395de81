"""Multi-LoRA throughput on the default model (SmolLM2-135M-Instruct): requests spread over
four rank-16 adapters against the same requests on the base model, in one process.

Adapters: random PEFT folders (A and B normal, std 0.02) on q/k/v/o/gate/up/down, written into
a temporary directory and loaded at start (``lora.modules``). Arms, alternated round by round
(A, B, C, A, B, C, ...) so that a busy machine slows each about equally:

- ``lora``: 32 requests, request i with adapter i % 4, on an engine with ``lora.enabled``;
- ``base``: the same 32 requests without adapters, on the same engine (base rows skip the LoRA
  work entirely: this is what the adapters themselves cost);
- ``off``: the same 32 requests on an engine without LoRA (what enabling LoRA costs rows that
  use no adapter);

and the same three at batch 1 (one request at a time, each of its own adapter in turn).
Output tokens/s per arm: the median over rounds with the spread (min-max); the ratio is
``lora / base`` of the medians (the issue's aim: >= 0.8x at batch 32). Greedy, ``ignore_eos``,
random token-id prompts. Slow (minutes): ``pytest benchmarks/test_lora_bench.py --benchmark-only
-s``; or run this file with python for the table alone (``LORA_BENCH_ROUNDS`` sets the rounds).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

NUM_ADAPTERS = 4
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(hf_config, root: Path, n: int = NUM_ADAPTERS, rank: int = RANK,
                   seed: int = 0) -> list[Path]:
    """``n`` random PEFT LoRA folders for a Llama-family config (the names and shapes PEFT's
    ``save_pretrained`` writes)."""
    from safetensors.torch import save_file

    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    shapes = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv), "v_proj": (h, kv),
              "o_proj": (heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for a in range(n):
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for mod in TARGETS:
                part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{mod}"
                inp, out = shapes[mod]
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
                tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
        d = root / f"adapter{a}"
        d.mkdir(parents=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "bias": "none"}))
        dirs.append(d)
    return dirs


def _prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pool = [t for t in range(len(tokenizer)) if t not in special]
    return [rng.choices(pool, k=length) for _ in range(n)]


def _tok_s(llm, prompts, loras, max_tokens: int, label: str = "") -> float:
    from llmkit import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    print(f"  {label}: {tok_s:.1f} tok/s ({elapsed:.1f} s)", file=sys.stderr, flush=True)
    return tok_s


def run(rounds: int = 3, batch: int = 32, input_len: int = 128, output_len: int = 64,
        batch1_output_len: int = 64) -> dict:
    from llmkit import LLM
    from llmkit.models.loader import resolve_model_source
    from llmkit.config.compose import build_config

    base_cfg = build_config(None)
    source = resolve_model_source(base_cfg.model)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        dirs = write_adapters(source.hf_config, Path(tmp))
        modules = [f"a{i}={d}" for i, d in enumerate(dirs)]
        groups = {"kv_cache": {"memory_gib": 2.0}, "scheduler": {"max_num_seqs": batch}}
        lora_llm = LLM(None, lora={"enabled": True, "max_loras": NUM_ADAPTERS,
                                   "max_lora_rank": RANK, "modules": modules}, **groups)
        off_llm = LLM(None, **groups)
        tok = lora_llm.get_tokenizer()
        adapters = lora_llm.list_loras()
        prompts = _prompts(tok, batch, input_len, seed=1)
        spread = [adapters[i % NUM_ADAPTERS] for i in range(batch)]
        # warm-up: every adapter resident, the kernels built, one short run per engine
        lora_llm.generate(prompts[:NUM_ADAPTERS], None, lora_request=spread[:NUM_ADAPTERS],
                          use_tqdm=False)
        off_llm.generate(prompts[:2], None, use_tqdm=False)
        figures: dict[str, list[float]] = {k: [] for k in (
            "lora", "base", "off", "lora_b1", "base_b1", "off_b1")}
        for r in range(rounds):
            # fresh prompts each round (no prefix-cache hits across rounds or arms)
            ps = _prompts(tok, batch, input_len, seed=100 + r)
            figures["lora"].append(_tok_s(lora_llm, ps, spread, output_len, label="lora"))
            ps = _prompts(tok, batch, input_len, seed=200 + r)
            figures["base"].append(_tok_s(lora_llm, ps, None, output_len, label="base"))
            ps = _prompts(tok, batch, input_len, seed=300 + r)
            figures["off"].append(_tok_s(off_llm, ps, None, output_len, label="off"))
            p1 = _prompts(tok, 1, input_len, seed=400 + r)
            figures["lora_b1"].append(_tok_s(lora_llm, p1, adapters[r % NUM_ADAPTERS],
                                             batch1_output_len, label="lora_b1"))
            p1 = _prompts(tok, 1, input_len, seed=500 + r)
            figures["base_b1"].append(_tok_s(lora_llm, p1, None, batch1_output_len,
                                             label="base_b1"))
            p1 = _prompts(tok, 1, input_len, seed=600 + r)
            figures["off_b1"].append(_tok_s(off_llm, p1, None, batch1_output_len,
                                            label="off_b1"))
        ops = next(m.method.ops.name for m in lora_llm.engine.executor.runner.model.modules()
                   if hasattr(m, "method") and hasattr(m.method, "ops"))
        dtype = str(next(lora_llm.engine.executor.runner.model.parameters()).dtype)
        lora_llm.shutdown()
        off_llm.shutdown()
    med = {k: statistics.median(v) for k, v in figures.items()}
    return {"rounds": rounds, "batch": batch, "input_len": input_len, "output_len": output_len,
            "threads": torch.get_num_threads(), "dtype": dtype, "lora_ops": ops,
            "figures": figures, "median": med,
            "ratio": med["lora"] / med["base"], "ratio_vs_off": med["lora"] / med["off"],
            "ratio_b1": med["lora_b1"] / med["base_b1"],
            "ratio_b1_vs_off": med["lora_b1"] / med["off_b1"],
            "base_vs_off": med["base"] / med["off"]}


def format_result(res: dict) -> str:
    lines = [f"multi-LoRA: {NUM_ADAPTERS} adapters of rank {RANK} (q/k/v/o/gate/up/down), "
             f"{res['batch']} requests x {res['input_len']} -> {res['output_len']} tokens, "
             f"{res['rounds']} rounds, {res['threads']} threads, {res['dtype']}, "
             f"LoRA ops {res['lora_ops']}"]
    for key, label in (("lora", f"batch {res['batch']}, spread over 4 adapters"),
                       ("base", f"batch {res['batch']}, base (LoRA engine)"),
                       ("off", f"batch {res['batch']}, base (LoRA off)"),
                       ("lora_b1", "batch 1, one adapter"),
                       ("base_b1", "batch 1, base (LoRA engine)"),
                       ("off_b1", "batch 1, base (LoRA off)")):
        v = res["figures"][key]
        lines.append(f"  {label:38s} {res['median'][key]:8.1f} output tok/s "
                     f"(min {min(v):.1f}, max {max(v):.1f})")
    lines.append(f"  ratio lora/base: batch {res['batch']} {res['ratio']:.2f}x, batch 1 "
                 f"{res['ratio_b1']:.2f}x; lora/off: {res['ratio_vs_off']:.2f}x, "
                 f"{res['ratio_b1_vs_off']:.2f}x; base rows on the LoRA engine / off: "
                 f"{res['base_vs_off']:.2f}x")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.benchmark(group="multi-lora")
def test_lora_throughput_vs_base(benchmark, smollm2_gguf):
    rounds = int(os.environ.get("LORA_BENCH_ROUNDS", "3"))
    res = benchmark.pedantic(run, kwargs={"rounds": rounds}, rounds=1, iterations=1)
    benchmark.extra_info.update(ratio=res["ratio"], ratio_b1=res["ratio_b1"],
                                median_tok_s=res["median"])
    print("\n" + format_result(res))
    # Aim 0.8x; the floor leaves room for a busy shared machine.
    assert res["ratio"] >= 0.7, format_result(res)
    assert res["ratio_b1"] >= 0.7, format_result(res)


if __name__ == "__main__":
    print(format_result(run(rounds=int(os.environ.get("LORA_BENCH_ROUNDS", "3")))))
