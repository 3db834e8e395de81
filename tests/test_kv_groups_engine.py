"""KV-cache groups end to end (issue 33): the scheduler hands per-group block ids to the
runner, which keeps one block table per group over one shared pool and gives each layer its
group's metadata. A tiny Llama whose odd layers declare a sliding window longer than any
request is the same model as the plain one, so its greedy tokens must equal Hugging Face's
under chunked prefill, preemption and prefix hits."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.attention.kv_spec import FullAttentionSpec, SlidingWindowSpec
from llmkit.config.errors import ConfigError
from llmkit.kv_cache.hybrid import HybridKVCacheManager
from llmkit.models.llama import LlamaForCausalLM

from helpers.greedy_engine import (assert_greedy_matches, assert_grouped_blocks_back,
                                   hf_greedy, make_prompts)
from helpers.tiny_bamba import build_bamba_dir

MAX_TOKENS = 24


def interleaved_specs(self):
    """Even layers full attention, odd ones a window no request reaches (same outputs)."""
    return [FullAttentionSpec(self.num_kv_heads, self.head_dim) if i % 2 == 0 else
            SlidingWindowSpec(self.num_kv_heads, self.head_dim, sliding_window=10 ** 6)
            for i in range(self.num_layers)]


@pytest.fixture(scope="module")
def model_and_reference(tiny_model_dir):
    d = tiny_model_dir("llama", num_hidden_layers=4)
    prompts = make_prompts(600, 6, seed=0)
    return d, prompts, hf_greedy(d, prompts, MAX_TOKENS)


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
    assert_greedy_matches(llm, prompts + prompts, refs + refs, MAX_TOKENS)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    assert_grouped_blocks_back(llm)
    assert set(kv.kv_usage_by_group()) == {"0:full", "1:sliding_window(1000000)"}


def test_ngram_drafts_over_grouped_tables_match_hf(model_and_reference, monkeypatch):
    """Draft tokens' slots are reserved in every group and given back in every group when
    rejected (shrink_slots), so verifying drafts leaves the greedy tokens unchanged."""
    d, prompts, refs = model_and_reference
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", interleaved_specs)
    llm = LLM(str(d), dtype="float32", kv_cache={"block_size": 4},
              speculative={"name": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    # prompts that repeat themselves, so that n-gram lookups propose (and some are rejected)
    looped = [p[:6] * 4 for p in prompts]
    assert_greedy_matches(llm, looped, hf_greedy(d, looped, MAX_TOKENS), MAX_TOKENS)
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0
    assert_grouped_blocks_back(llm)


@pytest.mark.parametrize("overrides, key", [
    ({"speculative": {"name": "draft_model", "model": "{model}",
                      "num_speculative_tokens": 2}}, "speculative.name"),
    ({"kv_cache": {"pinned_prefixes": [[1, 2, 3, 4]]}}, "kv_cache.pinned_prefixes"),
])
def test_what_does_not_carry_every_group_is_refused_by_name(model_and_reference, monkeypatch,
                                                            overrides, key):
    d, _, _ = model_and_reference
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", interleaved_specs)
    if "speculative" in overrides:  # the model drafts for itself
        overrides = {"speculative": {**overrides["speculative"], "model": str(d)}}
    with pytest.raises(ConfigError) as err:
        LLM(str(d), dtype="float32", **overrides)
    assert err.value.key == key


@pytest.mark.parametrize("settings, key", [
    ({"parallel": {"pipeline_parallel_size": 2}}, "parallel.pipeline_parallel_size"),
    ({"kv_transfer": {"name": "shared_memory"}}, "kv_transfer"),
    ({"kv_offload": {"host_gib": 1.0}}, "kv_offload.host_gib"),
    ({"speculative": {"name": "ngram", "num_speculative_tokens": 2}}, "speculative.name"),
])
def test_start_up_checks_name_the_key(settings, key):
    """(Checked on the groups the workers report: a spawned worker would not see a
    monkeypatched model.) ngram drafts are refused only beside a recurrent state."""
    from llmkit.attention.kv_spec import RecurrentStateSpec
    from llmkit.config.schema import EngineConfig
    from llmkit.engine.loop.kv_groups_check import check_kv_cache_groups
    from llmkit.kv_cache.groups import group_kv_cache_specs

    config = EngineConfig.model_validate({"model": {"path": "/nowhere"}, **settings})
    full = FullAttentionSpec(2, 16)
    recurrent = group_kv_cache_specs([RecurrentStateSpec(((4, 4),)), full])
    with pytest.raises(ConfigError) as err:
        check_kv_cache_groups(config, recurrent)
    assert err.value.key == key
    check_kv_cache_groups(config, group_kv_cache_specs([full] * 2))  # one group: anything
    if key == "speculative.name":
        check_kv_cache_groups(config, group_kv_cache_specs([full, SlidingWindowSpec(
            2, 16, sliding_window=8)]))


def test_grouped_block_ids_travel_to_worker_processes():
    """The step codec (msgspec) carries per-group block ids and offsets (tuples arrive as
    lists), and the persistent batch takes either."""
    from llmkit.executor.step_codec import StepDecoder, StepEncoder
    from llmkit.scheduler.base import CachedRequestData, NewRequestData, SchedulerOutput
    from llmkit.worker.input_batch import InputBatch

    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5], 5, SamplingParams(),
                                           ([3, 4], [0, 7]), 0)],
        scheduled_cached_reqs=CachedRequestData(["a"], [([9], [])], [5], [(1, 2)]),
        num_scheduled_tokens={"a": 5}, total_num_scheduled_tokens=5,
        finished_req_ids=set(), preempted_req_ids=set())
    back = StepDecoder().decode(StepEncoder().encode(so))
    assert back.scheduled_new_reqs[0].block_ids == [[3, 4], [0, 7]]
    assert back.scheduled_cached_reqs.block_ids_offset == [[1, 2]]
    batch = InputBatch(2, 16, 8, num_groups=2)
    row = batch.add_request(back.scheduled_new_reqs[0], None)
    c = back.scheduled_cached_reqs
    batch.set_group_block_ids(row, c.new_block_ids[0], c.block_ids_offset[0])
    assert batch.block_tables[0][row, :2].tolist() == [3, 9]
    assert batch.block_tables[1][row, :2].tolist() == [0, 7]
    assert [batch.group_num_blocks[g][row] for g in range(2)] == [2, 2]


def test_recurrent_states_share_the_pool_with_attention_end_to_end(tmp_path, tiny_tokenizer):
    """Bamba (Mamba-2 states beside attention layers) through the engine: the states sit in
    the K/V halves of the attention pages (the block size raised to hold them), one block per
    request; greedy tokens equal Hugging Face's under chunked prefill and preemption (no
    prefix caching for this model)."""
    # a state (d_state 16) larger than a 16-token attention page (2 KV heads)
    d = build_bamba_dir(tmp_path / "bamba", tiny_tokenizer, mamba_d_state=16,
                        num_key_value_heads=2)
    prompts = make_prompts(600, 6, seed=2)
    refs = hf_greedy(d, prompts, 20)
    llm = LLM(str(d), dtype="float32", kv_cache={"num_blocks": 7},
              scheduler={"max_num_batched_tokens": 16})
    kv = llm.engine.kv_cache_manager
    assert not kv.enable_prefix_caching and kv.block_size == 64  # raised to hold a state
    assert_greedy_matches(llm, prompts, refs, 20)
    assert llm.engine.stats().num_preemptions_total > 0
    assert_grouped_blocks_back(llm)
