"""Sliding-window Llama-family models (issue 33): Mistral (every layer slides) and Qwen2 with
``use_sliding_window`` (the layers from ``max_window_layers`` on slide) keep only their window's
KV blocks while a request runs, with no cap on ``max_model_len``, and their greedy tokens equal
Hugging Face's on prompts longer than the window, under chunked prefill, preemption and prefix
hits."""
from __future__ import annotations

import pytest

from llmkit import LLM
from llmkit.attention.kv_spec import FullAttentionSpec, SlidingWindowSpec
from llmkit.kv_cache.group_managers import SlidingWindowGroup

from helpers.greedy_engine import (assert_greedy_matches, assert_grouped_blocks_back,
                                   hf_greedy, make_prompts)

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
    prompts = make_prompts(600, 6, seed=1)
    return arch, d, prompts, hf_greedy(d, prompts, MAX_TOKENS)


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
    assert_greedy_matches(llm, prompts + prompts, refs + refs, MAX_TOKENS)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    # held: at most the blocks the window reaches into plus the one being written (5 of 4
    # tokens for a window of 12), where the longest request spans 22 blocks
    assert 0 < most_held <= WINDOW // BLOCK + 2
    assert_grouped_blocks_back(llm)
