"""Sliding-window Llama-family models (issue 33): Mistral (every layer slides) and Qwen2 with
``use_sliding_window`` (the layers from ``max_window_layers`` on slide) keep only their window's
KV blocks while a request runs, with no cap on ``max_model_len``, and their greedy tokens equal
Hugging Face's on prompts longer than the window, under chunked prefill, preemption and prefix
hits."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmkit import LLM, SamplingParams
from llmkit.attention.kv_spec import FullAttentionSpec, SlidingWindowSpec
from llmkit.kv_cache.group_managers import SlidingWindowGroup

WINDOW = 12
BLOCK = 4
MAX_TOKENS = 24
CASES = {
    # every layer slides: one window group
    "mistral": dict(sliding_window=WINDOW),
    # layer 0 full, layers 1 and 2 slide: three groups of one layer over one pool
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_dir):
    arch = request.param
    d = tiny_model_dir(arch, **CASES[arch])
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 600) for _ in range(k)] for k in (3, 17, 5, 40, 9, 64)]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    eos = hf.generation_config.eos_token_id
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_TOKENS, pad_token_id=eos)
            refs.append(out[0, len(p):].tolist())
    return arch, d, prompts, refs


def test_specs_follow_the_config(case):
    arch, d, _, _ = case
    llm = LLM(str(d), dtype="float32", kv_cache={"num_blocks": 64, "block_size": BLOCK})
    model = llm.engine.executor.runner.model
    window = SlidingWindowSpec(2, 16, sliding_window=WINDOW)
    full = FullAttentionSpec(2, 16)
    assert model.kv_cache_specs() == ([window] * 2 if arch == "mistral"
                                      else [full, window, window])
    assert llm.engine.model_facts.max_model_len == 512  # not capped at the window


def test_greedy_matches_hf_with_windows_freed_while_running(case, monkeypatch):
    arch, d, prompts, refs = case
    # 40 blocks for 12 requests of up to 88 tokens: preemptions (and, with Qwen2's full
    # layer, some waiting); each prompt twice: prefix hits; 16 tokens a step: chunks.
    llm = LLM(str(d), dtype="float32", kv_cache={"num_blocks": 40, "block_size": BLOCK},
              scheduler={"max_num_batched_tokens": 16})
    kv = llm.engine.kv_cache_manager
    windows = [m for m in kv.managers if isinstance(m, SlidingWindowGroup)]
    assert windows and all(m.window == WINDOW for m in windows)
    most_held = 0
    allocate = kv.allocate_slots

    def watched(request, num_new_tokens, *args, **kwargs):
        nonlocal most_held
        new = allocate(request, num_new_tokens, *args, **kwargs)
        if new is not None and num_new_tokens == 1 and request.num_computed_tokens > WINDOW:
            for m in windows:  # a decode step: the window's blocks, and the one it writes
                most_held = max(most_held, m.num_held(request.request_id))
        return new

    monkeypatch.setattr(kv, "allocate_slots", watched)
    outs = llm.generate(prompts + prompts, SamplingParams(temperature=0.0,
                                                          max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == (refs + refs)[i], f"request {i} differs from HF"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    # held: at most the blocks the window reaches into plus the one being written (5 of 4
    # tokens for a window of 12), where the longest request spans 22 blocks
    assert 0 < most_held <= WINDOW // BLOCK + 2
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1
