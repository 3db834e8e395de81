"""End to end through LLM.generate: greedy tokens equal Hugging Face transformers' on tiny
random models, whatever the scheduling (preemption, chunked prefill, prefix-cache hits)."""
from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from llmkit import LLM, SamplingParams

from helpers.greedy_engine import hf_greedy, make_prompts

ARCHS = ["llama", "qwen2", "qwen3"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    refs = {}
    for arch in ARCHS:
        d = tiny_model_dir(arch)
        vocab = AutoModelForCausalLM.from_pretrained(d).config.vocab_size
        prompts = make_prompts(vocab)
        refs[arch] = (d, prompts, hf_greedy(d, prompts, MAX_TOKENS))
    return refs


def run_llmkit(model_dir, prompts, **groups) -> tuple[LLM, list]:
    llm = LLM(str(model_dir), dtype="float32", **groups)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return llm, outs


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


@pytest.mark.parametrize("native_kernels", ["on", "off"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(references, arch, native_kernels):
    """With the CPU platform's C++ kernels (on) and with torch ops only (off)."""
    model_dir, prompts, expected = references[arch]
    llm, outs = run_llmkit(model_dir, prompts, platform={"native_kernels": native_kernels})
    model = llm.engine.executor.runner.model
    bound = model.ctx.ops.name == "cpu"
    assert bound == (native_kernels == "on")
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == ref, f"prompt {i} differs from HF"
        reason = out.outputs[0].finish_reason
        assert reason == ("length" if len(ref) == MAX_TOKENS else "stop")
    assert_all_blocks_free(llm)


def test_one_request_at_a_time_matches_hf(references):
    """Batch-1 decoding (one row per step: the kernels' one-row linear and decode attention)."""
    model_dir, prompts, expected = references["llama"]
    llm = LLM(str(model_dir), dtype="float32", platform={"native_kernels": "on"})
    for p, ref in list(zip(prompts, expected))[:4]:
        out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref
    assert_all_blocks_free(llm)


def test_same_tokens_under_preemption(references):
    model_dir, prompts, expected = references["llama"]
    # 24 blocks of 4 tokens cannot hold 8 requests of up to 96 tokens: some get preempted.
    llm, outs = run_llmkit(model_dir, prompts, kv_cache={"num_blocks": 24, "block_size": 4})
    assert llm.engine.stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(llm)


def test_same_tokens_with_chunked_prefill(references):
    model_dir, prompts, expected = references["qwen2"]
    llm, outs = run_llmkit(model_dir, prompts, scheduler={"max_num_batched_tokens": 8})
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(llm)


def test_same_tokens_with_prefix_cache_hits(references):
    model_dir, prompts, _ = references["qwen3"]
    shared = prompts[5][:48]  # 48 tokens = 3 full blocks of 16
    batch = [shared + p[:7] for p in prompts[:4]]
    expected = hf_greedy(model_dir, batch, MAX_TOKENS)
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate(batch[:1], params, use_tqdm=False)
    rest = llm.generate(batch[1:], params, use_tqdm=False)
    outs = first + rest
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0
    assert all(o.num_cached_tokens == 48 for o in rest)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(references):
    model_dir, prompts, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32")
    stream = llm.stream(prompts[3], SamplingParams(max_tokens=20, temperature=0))
    next(stream)
    stream.close()  # abandoning a stream aborts the request
    assert_all_blocks_free(llm)


def test_prompt_longer_than_max_model_len_is_refused(references):
    model_dir, prompts, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32", overrides=["model.max_model_len=32"])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompts[3]], use_tqdm=False)
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=100, temperature=0),
                       use_tqdm=False)[0]
    # Output is capped by the model length: prompt + output <= max_model_len.
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].finish_reason == "length"


def test_text_prompts_and_detokenization(references):
    model_dir, _, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32")
    tok = llm.get_tokenizer()
    outs = llm.generate(["Hello there", "The quick brown fox"],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for out, prompt in zip(outs, ["Hello there", "The quick brown fox"]):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids,
                                                 skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_across_batches(references):
    model_dir, prompts, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32")
    p = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate([prompts[1]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(prompts[:4], [others, p, others, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompts[1]], SamplingParams(temperature=1.5, top_k=50, top_p=0.95,
                                                           seed=99, max_tokens=16),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_cache_salt_isolates_prefix_cache(references):
    model_dir, prompts, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32")
    p = SamplingParams(temperature=0, max_tokens=4)
    prompt = prompts[5]  # 64 tokens: 3 shareable full blocks of 16
    base = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], p,
                        use_tqdm=False)[0]
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], p,
                         use_tqdm=False)[0]
    same = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], p,
                        use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 48
    assert base.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_reset_prefix_cache(references):
    model_dir, prompts, _ = references["llama"]
    llm = LLM(str(model_dir), dtype="float32")
    p = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([prompts[5]], p, use_tqdm=False)
    stream = llm.stream(prompts[3], SamplingParams(temperature=0, max_tokens=8))
    next(stream)
    assert llm.engine.reset_prefix_cache() is False  # a request holds blocks
    stream.close()
    assert llm.engine.reset_prefix_cache() is True
    assert llm.generate([prompts[5]], p, use_tqdm=False)[0].num_cached_tokens == 0
