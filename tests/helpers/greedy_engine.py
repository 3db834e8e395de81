"""Greedy runs through ``LLM.generate`` against Hugging Face's ``generate`` on tiny models:
the prompts, HF's tokens, the comparison, and the block accounting once every request ended."""
from __future__ import annotations

import random

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmkit import LLM, SamplingParams

#: Prompt lengths: short and long, some past a few blocks, in no order.
PROMPT_LENS = (3, 17, 5, 40, 9, 64, 23, 31, 12, 50)


def make_prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of the first ``n`` of ``PROMPT_LENS`` (token ids from 5)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(k)] for k in PROMPT_LENS[:n]]


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int, *,
              attn_implementation: str | None = None, **config_overrides) -> list[list[int]]:
    """transformers' greedy tokens after each prompt, in float32 (its own cache: for a
    recurrent model, the chunked scan over the prompt, then the one-token update).
    ``config_overrides`` set attributes of the checkpoint's config before loading;
    ``attn_implementation`` picks transformers' attention (``eager`` where ``sdpa`` drops a
    model's soft-cap)."""
    kwargs: dict = {}
    if config_overrides:
        config = AutoConfig.from_pretrained(str(model_dir))
        for k, v in config_overrides.items():
            setattr(config, k, v)
        kwargs["config"] = config
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs)
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=eos if isinstance(eos, int) else eos[0])
            outs.append(gen[0, len(p):].tolist())
    return outs


def llm_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """llmkit's greedy tokens after each prompt."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_greedy_matches(llm: LLM, prompts: list[list[int]], refs: list[list[int]],
                          max_tokens: int) -> None:
    """llmkit's greedy tokens equal ``refs`` request by request (the message names the
    first that differs)."""
    got = llm_greedy(llm, prompts, max_tokens)
    assert len(got) == len(refs)
    for i, (tokens, ref) in enumerate(zip(got, refs)):
        assert tokens == ref, f"request {i} differs from HF"


def assert_grouped_blocks_back(llm: LLM) -> None:
    """A manager of KV-cache groups after every request ended: consistent, and every block
    free but the null block (which is never handed out)."""
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1
