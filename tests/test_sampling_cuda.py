"""Sampling on a CUDA device: the same distributions, seeds and engine results as on the CPU.

Skipped without CUDA. ``LLMKIT_TEST_DEVICE=cpu`` runs the same checks on the CPU (to check
the checks). The timings test prints per-step sampler costs (``-s`` shows them).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from llmkit.sampling import SamplingMetadata, SamplingParams, TorchSampler
from llmkit.sampling import topk_topp

DEVICE = torch.device(os.environ.get("LLMKIT_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device")

from helpers import sampling_distributions as dist  # noqa: E402  (the CPU test's definitions)


def draw(case, seed: int, n: int = dist.N) -> np.ndarray:
    temperature, top_k, top_p, min_p = case
    logits = torch.tensor(dist.LOGITS, dtype=torch.float32, device=DEVICE).expand(n, -1)

    def full(v, dtype=torch.float32):
        return torch.full((n,), v, dtype=dtype, device=DEVICE)

    meta = SamplingMetadata(temperature=full(temperature), all_greedy=False,
                            top_k=full(top_k, torch.long) if top_k else None,
                            top_p=full(top_p) if top_p < 1 else None,
                            min_p=full(min_p) if min_p else None)
    tokens = TorchSampler(seed=seed)(logits.contiguous(), meta)
    assert tokens.device.type == DEVICE.type
    return np.bincount(tokens.cpu().numpy(), minlength=len(dist.LOGITS))


@pytest.mark.parametrize("candidates", [256, 6])
@pytest.mark.parametrize("case", dist.CASES, ids=lambda c: "T{}-k{}-p{}-minp{}".format(*c))
def test_draws_match_filtered_distribution(monkeypatch, case, candidates):
    monkeypatch.setattr(topk_topp, "TOP_P_CANDIDATES", candidates)
    ok, why = dist.fits(draw(case, seed=dist.CASES.index(case)),
                        dist.expected_distribution(dist.LOGITS, *case))
    assert ok, why


def test_seeded_row_ignores_its_batch():
    def run(layout: str) -> list[int]:
        b, row = len(layout), layout.index("S")
        gen = torch.Generator(DEVICE).manual_seed(5)
        temp = torch.tensor([0.0 if c == "g" else 1.2 for c in layout], device=DEVICE)
        top_p = torch.tensor([0.5 if c == "k" else 1.0 for c in layout], device=DEVICE)
        sampler = TorchSampler(seed=1)
        out = []
        for _ in range(5):
            meta = SamplingMetadata(temperature=temp, all_greedy=False,
                                    top_p=top_p if "k" in layout else None,
                                    generators={row: gen})
            out.append(int(sampler(torch.zeros(b, 3000, device=DEVICE), meta)[row]))
        return out

    alone = run("S")
    assert len(set(alone)) > 1
    for layout in ["gS", "rkSg", "kkkkS"]:
        assert run(layout) == alone


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from llmkit import LLM

    model_dir = tiny_model_dir("llama")
    platform = "cuda" if DEVICE.type == "cuda" else "cpu"
    # The torch attention backend is CPU-only: the triton one runs on a GPU.
    attention = "triton" if DEVICE.type == "cuda" else "torch"
    return model_dir, LLM(str(model_dir), dtype="float32", platform=platform,
                          attention=attention, kv_cache={"block_size": 16, "num_blocks": 256})


def test_engine_sampling_features(engine):
    from transformers import AutoModelForCausalLM

    model_dir, llm = engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 600, 40).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + c.token_ids])).logits[0].float().log_softmax(-1)
    worst = 0.0
    for j, tok in enumerate(c.token_ids):
        worst = max(worst, abs(c.logprobs[j][tok].logprob - ref[len(prompt) - 1 + j, tok].item()))
    for j in range(1, len(prompt)):
        worst = max(worst, abs(out.prompt_logprobs[j][prompt[j]].logprob
                               - ref[j - 1, prompt[j]].item()))
    print(f"\n[{DEVICE}] max |logprob - HF float32 CPU| = {worst:.2e}")
    assert worst < 1e-3  # a GPU's float32 kernels round differently from the CPU's
    # n > 1 prefills once; penalties, bias, bad words, stop strings run.
    fresh = rng.integers(5, 600, 40).tolist()
    before = llm.engine.kv_cache_manager.prefix_cache_stats.hits
    many = llm.generate([fresh], SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=6, presence_penalty=0.5,
        repetition_penalty=1.2, logit_bias={5: 2.0}, bad_words=["the"], top_k=20, top_p=0.9,
        min_p=0.01), use_tqdm=False)[0]
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits - before == 2 * 32
    assert [o.index for o in many.outputs] == [0, 1, 2]
    again = llm.generate([fresh], SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=6, presence_penalty=0.5,
        repetition_penalty=1.2, logit_bias={5: 2.0}, bad_words=["the"], top_k=20, top_p=0.9,
        min_p=0.01), use_tqdm=False)[0]
    assert [o.token_ids for o in many.outputs] == [o.token_ids for o in again.outputs]
    text = c.text
    if len(text) > 6:
        stop = text[3:6]
        s = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0]
        assert s.outputs[0].text == text[:text.find(stop)]
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_engine_batch_invariance(engine):
    _, llm = engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 600, int(n)).tolist() for n in rng.integers(3, 60, 32)]
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    batch = llm.generate(prompts, sp, use_tqdm=False)
    worst, diverged = 0.0, 0
    for i in (0, 7, 19, 31):
        a = llm.generate([prompts[i]], sp, use_tqdm=False)[0].outputs[0]
        b = batch[i].outputs[0]
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                diverged += 1
                break
            worst = max(worst, abs(a.logprobs[j][ta].logprob - b.logprobs[j][tb].logprob))
    print(f"\n[{DEVICE}] float32 greedy alone vs batch of 32: max logprob diff {worst:.2e}, "
          f"{diverged}/4 sequences diverged")
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[1:5] + [prompts[0]], [sp] * 4 + [seeded], use_tqdm=False)
    mixed2 = llm.generate([prompts[0]] + prompts[1:9], [seeded] + [sp] * 8, use_tqdm=False)
    print(f"[{DEVICE}] seeded alone {alone}\n  last of 5 {mixed[4].outputs[0].token_ids}\n"
          f"  first of 9 {mixed2[0].outputs[0].token_ids}")
    # Float32 logits may differ in the last bits with the batch; the draws only flip where
    # p / E is within that of a tie, so the first tokens always agree.
    assert mixed[4].outputs[0].token_ids[:3] == alone[:3] == mixed2[0].outputs[0].token_ids[:3]


def test_sampler_step_timings():
    from llmkit.scheduler.base import NewRequestData
    from llmkit.worker.input_batch import InputBatch
    from llmkit.worker.sample_step import LogitsLayout, build_sampling_metadata

    rows, vocab = (256, 151_936) if DEVICE.type == "cuda" else (64, 32_000)
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).float() + 1
    peaked = (-1.5 * ranks.log()).to(DEVICE)

    def sync():
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    def bench(f, n=10):
        f()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            f()
        sync()
        return (time.perf_counter() - t) / n * 1e3

    kinds = {
        "greedy": SamplingParams(temperature=0),
        "random": SamplingParams(temperature=0.8),
        "top-k 50": SamplingParams(temperature=0.8, top_k=50),
        "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "k+p+min-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1,
                                    presence_penalty=0.5, frequency_penalty=0.5),
        "logprobs 5": SamplingParams(temperature=0, logprobs=5),
        "seeded": SamplingParams(temperature=0.8, seed=1),
    }
    print(f"\n[{DEVICE}] sampler, {rows} rows x {vocab} vocabulary (ms per step)")
    sampler = TorchSampler()
    for name, sp in kinds.items():
        batch = InputBatch(rows, 512, 32)
        for i in range(rows):
            gen = torch.Generator(DEVICE).manual_seed(i) if sp.seed is not None else None
            batch.add_request(NewRequestData(f"r{i}", list(range(5, 305)), 100, sp, [], 0,
                                             eos_token_id=2), gen)
        idx = np.arange(rows)
        meta_ms = bench(lambda: build_sampling_metadata(batch, LogitsLayout.one_each(idx), vocab, DEVICE))
        meta = build_sampling_metadata(batch, LogitsLayout.one_each(idx), vocab, DEVICE)
        flat_ms = bench(lambda: sampler.sample(flat, meta))
        peaked_ms = bench(lambda: sampler.sample(peaked, meta))
        print(f"  {name:12s} metadata {meta_ms:7.3f}  flat logits {flat_ms:8.3f}  "
              f"peaked logits {peaked_ms:8.3f}")
