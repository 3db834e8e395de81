"""The KV offload tests' engines (a tiny Llama whose small pool must evict), prompts and
fixtures: the model, and greedy tokens computed without eviction to compare against."""
from __future__ import annotations

import random

import pytest

from llmkit import LLM, SamplingParams

BLOCK = 4
SMALL_POOL = 12  # blocks: one 30-token prompt (8 blocks) fits, two do not
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def two_prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.randrange(5, 600) for _ in range(30)],
            [rng.randrange(5, 600) for _ in range(30)])


def offload_llm(model_dir, num_blocks: int = SMALL_POOL, **offload) -> LLM:
    groups = {"kv_offload": offload} if offload else {}
    return LLM(str(model_dir), dtype="float32", attention="torch",
               kv_cache={"num_blocks": num_blocks, "block_size": BLOCK}, **groups)


def greedy_tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks still held after every request ended"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens computed from scratch in a pool large enough to need no eviction."""
    a, b = two_prompts()
    llm = offload_llm(model, num_blocks=64)
    out = {"a": greedy_tokens(llm, a), "b": greedy_tokens(llm, b)}
    llm.shutdown()
    return out
