"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers on tiny random checkpoints
(float32, weights x3): greedy tokens identical over 20 tokens for 7 prompts, also under chunked
prefill, preemption and prefix-cache hits, with the engine's real KV-cache groups (sliding
layers free the blocks behind their window).

The checkpoints set what the implementation could get wrong: windows shorter than the prompts,
``layer_types`` interleaves, ``query_pre_attn_scalar`` unlike head_dim, soft caps low enough to
change the tokens (checked against a reference without them), Gemma 3's local rope base unlike
its global one and a linear-scaled global rope."""
from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.attention.kv_spec import FullAttentionSpec, SlidingWindowSpec

from helpers.greedy_engine import hf_greedy as shared_hf_greedy

MAX_TOKENS = 20
WINDOW = 6
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh", sliding_window=WINDOW,
            query_pre_attn_scalar=24)
CONFIGS = {
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=6.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=5, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                            "factor": 4.0}})),
}


def build_gemma(arch: str, out, tokenizer, **overrides):
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, values = CONFIGS[arch]
    config = getattr(transformers, class_name)(
        **BASE, **values, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w: w random around 0
                param.uniform_(-0.5, 0.5)
            param.mul_(3.0)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    # all but one longer than the window
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 9, 40, 12, 29, 22)]


def hf_greedy(model_dir, prompts, max_tokens=MAX_TOKENS, **overrides) -> list[list[int]]:
    """HF's tokens with eager attention (the soft-caps)."""
    return shared_hf_greedy(model_dir, prompts, max_tokens, attn_implementation="eager",
                            **overrides)


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request, tmp_path_factory, tiny_tokenizer):
    arch = request.param
    model_dir = build_gemma(arch, tmp_path_factory.mktemp(arch), tiny_tokenizer)
    prompts = make_prompts(len(tiny_tokenizer))
    return arch, model_dir, prompts, hf_greedy(model_dir, prompts)


def greedy(model_dir, prompts, **groups) -> tuple[LLM, list[list[int]]]:
    """Greedy tokens of a float32 ``LLM`` on ``model_dir`` with these config groups."""
    llm = LLM(str(model_dir), dtype="float32", **groups)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_blocks_back(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1  # all back but the null block
    kv.check_integrity()


def hf_last_logprobs(model_dir, ids: list[int], **overrides) -> torch.Tensor:
    """HF's log-softmax at the last position of ``ids``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


# What, set back to a default, changes HF's own greedy tokens (so the parity tests test it).
MATTERS = {
    "gemma2": [{"attn_logit_softcapping": None}, {"sliding_window": 4096},
               {"query_pre_attn_scalar": 16}],
    "gemma3": [{"sliding_window": 4096}, {"query_pre_attn_scalar": 16},
               {"rope_parameters": {k: dict(CONFIGS["gemma3"][1]["rope_parameters"][
                   "full_attention"]) for k in ("sliding_attention", "full_attention")}}],
}


def test_the_checkpoint_sets_what_matters(reference):
    """The windows are shorter than the prompts, and each non-default value (the attention soft
    cap, the window, query_pre_attn_scalar, Gemma 3's local rope) changes HF's own tokens."""
    arch, model_dir, prompts, expected = reference
    assert sum(len(p) > WINDOW for p in prompts) >= 6
    for overrides in MATTERS[arch]:
        got = hf_greedy(model_dir, prompts[1:4], max_tokens=12, **overrides)
        assert got != [e[:12] for e in expected[1:4]], overrides


def test_greedy_matches_hf_and_final_soft_cap(reference):
    """The C++ kernels' path (decode in place through each group's block table); the final
    logit soft cap -- invisible to greedy choices -- checked on the logprobs."""
    arch, model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), dtype="float32", platform={"native_kernels": "on"})
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True, logprobs=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    model = llm.engine.executor.runner.model
    assert model.ctx.ops.name == "cpu"
    kinds = model.model.layer_types
    assert model.kv_cache_specs() == [
        SlidingWindowSpec(2, 16, sliding_window=WINDOW) if k == "sliding_attention"
        else FullAttentionSpec(2, 16) for k in kinds]
    groups = llm.engine.kv_cache_manager.groups  # (equal-size groups: maybe several a kind)
    assert {type(g.spec) for g in groups} == {SlidingWindowSpec, FullAttentionSpec}
    first = outs[3].outputs[0].logprobs[0]
    ref = hf_last_logprobs(model_dir, prompts[3])
    for tok, lp in first.items():
        assert abs(lp.logprob - ref[tok].item()) < 1e-4
    uncapped = hf_last_logprobs(model_dir, prompts[3], final_logit_softcapping=None)
    assert max(abs(uncapped[t] - ref[t]).item() for t in first) > 1e-2  # the cap matters
    assert_blocks_back(llm)


def test_chunked_prefill_keeps_windows_bounded(reference):
    """Torch ops (no C++ kernels); 8-token chunks: long prompts split across steps, windows
    crossing chunks. The real groups free the blocks behind each window: a sliding group
    holds no more than the window and one chunk's blocks, a full group the whole context."""
    arch, model_dir, prompts, expected = reference
    chunk, block = 8, 2
    llm = LLM(str(model_dir), dtype="float32", platform={"native_kernels": "off"},
              kv_cache={"block_size": block}, scheduler={"max_num_batched_tokens": chunk})
    kv = llm.engine.kv_cache_manager
    held: dict[str, int] = {"sliding": 0, "full": 0}
    allocate = kv.allocate_slots

    def spy(*args, **kwargs):
        out = allocate(*args, **kwargs)
        for group, manager in zip(kv.groups, kv.managers):
            kind = "sliding" if isinstance(group.spec, SlidingWindowSpec) else "full"
            for blocks in manager.req_to_blocks.values():
                held[kind] = max(held[kind], sum(b is not kv.null_block for b in blocks))
        return out

    kv.allocate_slots = spy
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    assert held["full"] >= (longest - 1) // block
    assert held["sliding"] <= -(-(WINDOW - 1 + chunk) // block) + 1 < longest // block
    assert_blocks_back(llm)


def test_preemption(reference, caplog):
    arch, model_dir, prompts, expected = reference
    # a pool that holds the longest request but not every request at once; for Gemma 3 (three
    # equal-size groups, two of them sliding) too small for the 40-token prompt's blocks in one
    # chunk (3 x 10 > 27): the scheduler runs it in shorter chunks instead of refusing it
    blocks = 28
    with caplog.at_level("INFO", logger="llmkit"):
        llm, got = greedy(model_dir, prompts, kv_cache={"num_blocks": blocks, "block_size": 4})
    # start-up says the groups and their blocks
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("KV cache groups: ")]
    assert len(said) == 1
    assert f"sliding_window({WINDOW})" in said[0] and " x full [layers " in said[0]
    assert f"; {blocks} blocks of 4 tokens" in said[0]
    assert llm.engine.stats().num_preemptions_total > 0
    assert got == expected
    assert_blocks_back(llm)


def test_prefix_cache_hits(reference):
    """Repeated prompts hit the cache (the longest prefix every group serves): one prompt,
    then all 7 twice."""
    arch, model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), dtype="float32", kv_cache={"block_size": 4})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[3:4], params, use_tqdm=False)
    again = llm.generate([prompts[3], prompts[5], prompts[3]], params, use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[2].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in first + again] == \
        [expected[3], expected[3], expected[5], expected[3]]
    # every prompt, then every prompt again: each of the second round longer than a block hits
    once = llm.generate(prompts, params, use_tqdm=False)
    twice = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o, p in zip(twice, prompts) if len(p) > 4)
    assert [o.outputs[0].token_ids for o in once + twice] == expected + expected
    assert_blocks_back(llm)


def test_hub_spelling_of_gemma3_rope_and_layer_pattern():
    """The Hub's ``rope_local_base_freq`` / ``rope_scaling`` / ``sliding_window_pattern`` give
    the same tables as transformers 5's ``rope_parameters`` / ``layer_types``."""
    from llmkit.models.gemma import layer_types
    from llmkit.models.gemma3 import gemma3_rope_parameters

    hub = SimpleNamespace(num_hidden_layers=7, sliding_window=4, sliding_window_pattern=6,
                          rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert layer_types(hub) == ["sliding_attention"] * 5 + ["full_attention",
                                                            "sliding_attention"]
    assert gemma3_rope_parameters(hub) == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    from transformers import Gemma3TextConfig

    v5 = Gemma3TextConfig(num_hidden_layers=7, sliding_window=4, sliding_window_pattern=6,
                          rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert layer_types(v5) == layer_types(hub)
    got = gemma3_rope_parameters(v5)
    for kind, want in gemma3_rope_parameters(hub).items():
        assert {k: got[kind][k] for k in want} == want
    bad = copy.copy(hub)
    bad.layer_types = ["sliding_attention", "chunked_attention"] + ["full_attention"] * 5
    with pytest.raises(ValueError, match="layer_types"):
        layer_types(bad)


@pytest.mark.parametrize("model_type,pattern", [("gemma3_text", None), ("gemma2", None),
                                                ("gemma3_text", 3)])
def test_model_and_kv_specs_agree_on_layer_kinds_without_layer_types(model_type, pattern):
    """A config without ``layer_types``: the model's attention kinds and the KV-cache specs come
    from one rule (Gemma 3's default pattern is 6, Gemma 2 alternates)."""
    from llmkit.models.gemma import layer_types
    from llmkit.models.kv_specs import gemma_kv_specs

    cfg = SimpleNamespace(model_type=model_type, num_hidden_layers=8, sliding_window=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          hidden_size=16)
    if pattern:
        cfg.sliding_window_pattern = pattern
    kinds = layer_types(cfg)
    want_full = {"gemma3_text": pattern or 6, "gemma2": 2}[model_type]
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == \
        [i for i in range(8) if (i + 1) % want_full == 0]
    specs = gemma_kv_specs(cfg)
    assert [isinstance(s, SlidingWindowSpec) for s in specs] == \
        [k == "sliding_attention" for k in kinds]
