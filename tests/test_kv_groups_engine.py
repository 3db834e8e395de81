"""KV-cache groups end to end (issue 33): the scheduler hands per-group block ids to the
runner, which keeps one block table per group over one shared pool and gives each layer its
group's metadata. A tiny Llama whose odd layers declare a sliding window longer than any
request is the same model as the plain one, so its greedy tokens must equal Hugging Face's
under chunked prefill, preemption and prefix hits."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmkit import LLM, SamplingParams
from llmkit.attention.kv_spec import FullAttentionSpec, SlidingWindowSpec
from llmkit.config.errors import ConfigError
from llmkit.kv_cache.hybrid import HybridKVCacheManager
from llmkit.models.llama import LlamaForCausalLM

MAX_TOKENS = 24


def interleaved_specs(self):
    """Even layers full attention, odd ones a window no request reaches (same outputs)."""
    return [FullAttentionSpec(self.num_kv_heads, self.head_dim) if i % 2 == 0 else
            SlidingWindowSpec(self.num_kv_heads, self.head_dim, sliding_window=10 ** 6)
            for i in range(self.num_layers)]


@pytest.fixture(scope="module")
def model_and_reference(tiny_model_dir):
    d = tiny_model_dir("llama", num_hidden_layers=4)
    rng = random.Random(0)
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
    return d, prompts, refs


def test_grouped_tables_match_hf_under_preemption_chunking_and_prefix_hits(
        model_and_reference, monkeypatch):
    d, prompts, refs = model_and_reference
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", interleaved_specs)
    # 48 blocks of 4 tokens (2 layers each) for 12 requests of up to 88 tokens: preemptions;
    # each prompt twice: prefix hits; 16 tokens a step: chunked prefill.
    llm = LLM(str(d), dtype="float32", kv_cache={"num_blocks": 48, "block_size": 4},
              scheduler={"max_num_batched_tokens": 16})
    kv = llm.engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.num_groups == 2
    runner = llm.engine.executor.runner
    assert runner.batch.num_groups == 2
    # one pool: two shared tensors, layer j of each group views tensor j
    caches = runner.kv_caches
    assert caches[0].data_ptr() == caches[1].data_ptr() != caches[2].data_ptr()
    assert caches[2].data_ptr() == caches[3].data_ptr()
    outs = llm.generate(prompts + prompts, SamplingParams(temperature=0.0,
                                                          max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == (refs + refs)[i], f"request {i} differs from HF"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1  # all back but the null block
    assert set(kv.kv_usage_by_group()) == {"0:full", "1:sliding_window(1000000)"}


@pytest.mark.parametrize("overrides, key", [
    ({"speculative": {"name": "ngram", "num_speculative_tokens": 2}}, "speculative.name"),
    ({"kv_cache": {"pinned_prefixes": [[1, 2, 3, 4]]}}, "kv_cache.pinned_prefixes"),
])
def test_what_does_not_carry_every_group_is_refused_by_name(model_and_reference, monkeypatch,
                                                            overrides, key):
    d, _, _ = model_and_reference
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", interleaved_specs)
    with pytest.raises(ConfigError) as err:
        LLM(str(d), dtype="float32", **overrides)
    assert err.value.key == key
