"""DeepSeek-V2 / V3 (issue 33): multi-head latent attention over the latent KV cache and
DeepSeek's MoE routers, against Hugging Face transformers on tiny random checkpoints.

The checkpoints set what would otherwise go untested: V2 with ``q_lora_rank`` and
``group_limited_greedy`` choosing 3 experts from 2 of 4 groups (choosing no more experts than
groups allowed, the group limit never changes a choice), V2-Lite's shape (no ``q_lora_rank``,
greedy), V3 with a non-zero ``e_score_correction_bias``, 4 groups, interleaved rope, YaRN with
``mscale`` unlike ``mscale_all_dim`` (so both the cos/sin factor and the softmax scale differ
from 1), a dense first layer, and ``v_head_dim`` unlike the q/k head dims;
test_the_checkpoint_sets_what_matters shows each changes transformers' own tokens. Every greedy
case runs under chunked prefill, preemption and prefix hits at once
(test_same_tokens_under_chunking_preemption_and_hits)."""
from __future__ import annotations

import random

import pytest
import torch

from llmkit import LLM, SamplingParams

from helpers.greedy_engine import hf_greedy

MAX_TOKENS = 20
PREFIX = 32
# Tiny models on a shared machine: one thread each (many threads on tiny matrices spin more
# than they compute when other processes hold the cores).
ONE_THREAD = {"num_threads": 1}
V3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
               original_max_position_embeddings=128, mscale=0.8, mscale_all_dim=1.0,
               beta_fast=32, beta_slow=1)
CASES = {
    "v2": ("DeepseekV2Config", dict(q_lora_rank=48, topk_method="group_limited_greedy",
                                    n_group=4, topk_group=2, num_experts_per_tok=3,
                                    routed_scaling_factor=1.5)),
    "v2_lite": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy",
                                         n_shared_experts=2, num_hidden_layers=2)),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=48, n_group=4, topk_group=2,
                                    num_experts_per_tok=3, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, rope_interleave=True,
                                    rope_parameters=V3_YARN)),
    # neox-layout rope, two dense layers (logits only: test_logits_match_hf_...)
    "v3_neox": ("DeepseekV3Config", dict(q_lora_rank=48, n_group=2, topk_group=1,
                                         rope_interleave=False, first_k_dense_replace=2)),
}
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
            max_position_embeddings=512, rms_norm_eps=1e-6, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, num_hidden_layers=3)


def _build(case: str, out, tokenizer):
    """A tiny random checkpoint of ``case``: weights x3 (peaked logits), random norms, and a
    random correction bias (a buffer, so the usual parameter loop would leave it zero)."""
    import transformers

    cls, overrides = CASES[case]
    config = getattr(transformers, cls)(**{
        **BASE, **overrides, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            p.mul_(3.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Six prompts of 3 to 41 tokens; the last two share prompt 3's first 32 tokens (two
    blocks of 16), for prefix-cache hits."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 5, 40, 6, 9)]
    prompts[4] = prompts[3][:PREFIX] + prompts[4]
    prompts[5] = prompts[3][:PREFIX] + prompts[5]
    return prompts


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    """``checkpoint(case) -> (dir, prompts, HF's greedy tokens)``, built once per case."""
    cache = {}

    def get(case: str):
        if case not in cache:
            d = _build(case, tmp_path_factory.mktemp(f"deepseek-{case}"), tiny_tokenizer)
            prompts = _prompts(len(tiny_tokenizer))
            cache[case] = (d, prompts, hf_greedy(d, prompts, MAX_TOKENS))
        return cache[case]

    return get


def _generate(model_dir, prompts, **groups) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), dtype="float32", platform=ONE_THREAD, **groups)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def _assert_specs_are_the_layers(llm: LLM) -> None:
    """The specs the engine (and llmkit config, from the config alone) allocates by are what
    each layer computes with."""
    model = llm.engine.executor.runner.model
    assert model.kv_cache_specs() == [layer.self_attn.kv_cache_spec()
                                      for layer in model.model.layers]


def _kv_bytes_per_token(llm: LLM) -> int:
    runner = llm.engine.executor.runner
    return runner.kv_cache_bytes_per_block() // runner.block_size


GREEDY_CASES = ("v2", "v2_lite", "v3")


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_tokens_match_hf_and_the_cache_holds_one_latent_row(checkpoint, case):
    model_dir, prompts, expected = checkpoint(case)
    llm, got = _generate(model_dir, prompts)
    assert any(len(t) == MAX_TOKENS for t in expected)
    for i, (g, want) in enumerate(zip(got, expected)):
        assert g == want, f"prompt {i} differs from HF"
    cfg = llm.engine.executor.runner.model.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 40 values per token per layer
    assert _kv_bytes_per_token(llm) == cfg.num_hidden_layers * latent * 4
    _assert_specs_are_the_layers(llm)
    cache = llm.engine.executor.runner.kv_caches[0]
    assert cache.shape[1:] == (llm.engine.executor.runner.block_size, latent)
    _assert_all_blocks_free(llm)


def test_same_tokens_with_chunked_prefill(checkpoint):
    model_dir, prompts, expected = checkpoint("v3")
    llm, got = _generate(model_dir, prompts, scheduler={"max_num_batched_tokens": 8})
    assert got == expected
    _assert_all_blocks_free(llm)


def test_same_tokens_under_preemption(checkpoint):
    model_dir, prompts, expected = checkpoint("v2")
    # 16 blocks of 4 tokens cannot hold 6 requests of up to 64 tokens: some get preempted
    llm, got = _generate(model_dir, prompts, kv_cache={"num_blocks": 16, "block_size": 4})
    assert llm.engine.stats().num_preemptions_total > 0
    assert got == expected
    _assert_all_blocks_free(llm)


def test_same_tokens_with_prefix_cache_hits(checkpoint):
    model_dir, prompts, expected = checkpoint("v3")
    llm = LLM(str(model_dir), dtype="float32", platform=ONE_THREAD)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate([prompts[3]], params, use_tqdm=False)
    rest = llm.generate(prompts[4:], params, use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits > 0
    assert all(o.num_cached_tokens == PREFIX for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == [expected[3]] + expected[4:]
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("case,mla", [(c, "absorbed") for c in GREEDY_CASES] +
                         [("v2", "expanded")])
def test_same_tokens_under_chunking_preemption_and_hits(checkpoint, case, mla):
    """Every case at once under the three: each prompt twice (12 requests; the repeats and
    the prompts sharing prompt 3's prefix hit the cache), 8 tokens a step (prompts cross
    steps), and 24 blocks of 4 tokens for requests of up to 61 tokens (preemptions)."""
    model_dir, prompts, expected = checkpoint(case)
    llm, got = _generate(model_dir, prompts + prompts, overrides=[f"model.mla={mla}"],
                         kv_cache={"num_blocks": 24, "block_size": 4},
                         scheduler={"max_num_batched_tokens": 8})
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    for i, (g, want) in enumerate(zip(got, expected + expected)):
        assert g == want, f"request {i} differs from HF"
    _assert_all_blocks_free(llm)


def _hf_greedy_with_zero_bias(model_dir, prompts) -> list[list[int]]:
    """HF's greedy tokens with every ``e_score_correction_bias`` set to zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)
    outs = []
    with torch.inference_mode():
        for b in biases:
            b.zero_()
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS,
                                 pad_token_id=model.generation_config.eos_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


# What, set back to a default, changes HF's own greedy tokens (so the parity tests test it).
MATTERS = {
    "v2": [{"n_group": 1, "topk_group": 1}, {"topk_method": "greedy"}],
    "v3": [{"n_group": 1, "topk_group": 1}, {"rope_interleave": False},
           {"rope_parameters": {**V3_YARN, "mscale_all_dim": 0.0}},
           {"rope_parameters": {**V3_YARN, "mscale": 1.0}}],
}


@pytest.mark.parametrize("case", list(MATTERS))
def test_the_checkpoint_sets_what_matters(checkpoint, case):
    """Each non-default value the greedy cases set (V2's group-limited choice, V3's groups,
    interleaved rope, YaRN's mscale and mscale_all_dim, the correction bias) changes
    transformers' own tokens, or the parity tests could not see it read wrongly."""
    model_dir, prompts, expected = checkpoint(case)
    assert all(len(t) == MAX_TOKENS for t in expected)
    for overrides in MATTERS[case]:
        assert hf_greedy(model_dir, prompts, MAX_TOKENS, **overrides) != expected, overrides
    if case == "v3":
        assert _hf_greedy_with_zero_bias(model_dir, prompts) != expected


def test_expanded_mla_gives_the_same_tokens_at_many_times_the_bytes(checkpoint):
    """model.mla=expanded caches K and V per head (V zero-padded to K's width): the same
    tokens, 4 heads x 2 x 24 values against the latent's 40 per token per layer."""
    model_dir, prompts, expected = checkpoint("v2")
    llm, got = _generate(model_dir, prompts, overrides=["model.mla=expanded"])
    assert got == expected
    cfg = llm.engine.executor.runner.model.config
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert _kv_bytes_per_token(llm) == cfg.num_hidden_layers * 2 * 4 * qk * 4
    _assert_specs_are_the_layers(llm)
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("case,mla", [("v3_neox", "absorbed"), ("v3", "expanded")])
def test_logits_match_hf_through_prefill_and_decode(tmp_path, tiny_tokenizer, case, mla):
    """Every position's logits of a prefill chunk, a second chunk and a decode step, with the
    CPU platform's C++ ops and linears, equal HF's (two requests in one batch)."""
    import dataclasses

    from helpers.model_logits import PagedRun, assert_close, hf_logits, load_llmkit, random_seqs
    from llmkit.models.loader import build_model

    model_dir = _build(case, tmp_path, tiny_tokenizer)
    seqs = random_seqs(len(tiny_tokenizer), [11, 7])
    refs = hf_logits(model_dir, seqs)
    model, source = load_llmkit(model_dir, kernels="native")
    if mla != "absorbed":
        model = build_model(source, dataclasses.replace(model.ctx, mla=mla), torch.device("cpu"))
    run = PagedRun(model, 2, 12)
    steps = [run.step({0: seqs[0][:6], 1: seqs[1][:4]}), run.step({0: seqs[0][6:10],
                                                                   1: seqs[1][4:6]}),
             run.step({0: seqs[0][10:], 1: seqs[1][6:]})]
    for i, ref in enumerate(refs):
        assert_close(torch.cat([s[i] for s in steps]), ref)


def test_bfloat16_is_as_accurate_as_transformers(tmp_path, tiny_tokenizer):
    """bf16 weights, activations and latent cache (the router in float32, as transformers
    keeps it): the error against float32 is no larger than transformers' own bf16 error."""
    from helpers.model_logits import (PagedRun, assert_bf16_as_accurate_as_hf, load_llmkit,
                                      random_seqs)

    model_dir = _build("v3", tmp_path, tiny_tokenizer)
    seqs = random_seqs(len(tiny_tokenizer), [12] * 4, seed=2)
    model, _ = load_llmkit(model_dir, torch.bfloat16, kernels="native")
    run = PagedRun(model, len(seqs), max(map(len, seqs)))
    run.kv_caches = [kv.to(torch.bfloat16) for kv in run.kv_caches]
    out = run.step(dict(enumerate(seqs)))
    assert_bf16_as_accurate_as_hf(out, model_dir, seqs)


@pytest.mark.slow  # two worker processes
def test_tensor_and_expert_parallel_match_hf(checkpoint, monkeypatch):
    """TP=2 with expert parallel (2 worker processes): each rank holds half the heads (its
    q_b / kv_b / o_proj shards, the whole latent) and half the routed experts; the shared
    experts' and routed experts' partial sums meet in one all-reduce."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model_dir, prompts, expected = checkpoint("v3")
    llm = LLM(str(model_dir), dtype="float32",
              parallel={"tensor_parallel_size": 2, "enable_expert_parallel": True})
    try:
        methods = llm.engine.backend_info.linear_methods
        assert any(m.startswith("fused-moe-expert-parallel[0/2]") for m in methods), methods
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.engine.shutdown()


def test_kv_offload_is_refused_by_name(checkpoint):
    """The offload tiers (and KV connectors) copy K/V layers: an MLA latent cache is refused
    at start-up, naming the key, rather than failing in the first step."""
    from llmkit.config.errors import ConfigError

    model_dir, _, _ = checkpoint("v2_lite")
    with pytest.raises(ConfigError, match="kv_offload.host_gib"):
        LLM(str(model_dir), dtype="float32", platform=ONE_THREAD,
            kv_offload={"host_gib": 0.01})


# -- the routers against transformers' own modules --------------------------------------------
@pytest.mark.parametrize("method,n_group,renormalize", [
    ("greedy", 1, False), ("group_limited_greedy", 4, False), ("group_limited_greedy", 2, True)])
def test_v2_router_matches_transformers(method, n_group, renormalize):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from llmkit.ops.moe_routing import softmax_group_topk

    cfg = DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                           num_experts_per_tok=3, topk_method=method, n_group=n_group,
                           topk_group=2, routed_scaling_factor=1.7)
    router = DeepseekV2TopkRouter(cfg)
    torch.manual_seed(1)
    router.weight.data.normal_()
    x = torch.randn(40, 32)
    logits, want_w, want_ids = router(x)
    w, ids = softmax_group_topk(logits, 3, method=method, n_group=n_group, topk_group=2,
                                renormalize=renormalize, scaling=1.7)
    if renormalize:  # (transformers' V2 never renormalises: DeepSeek's code and vLLM do)
        want_w = want_w / want_w.sum(-1, keepdim=True) * 1.7
    _assert_same_choice(w, ids, want_w, want_ids)


def test_v3_router_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from llmkit.ops.moe_routing import sigmoid_noaux_topk

    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                           num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(2)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(0.0, 0.5)
    x = torch.randn(40, 32)
    logits, want_w, want_ids = router(x)
    w, ids = sigmoid_noaux_topk(logits, router.e_score_correction_bias, 4, n_group=4,
                                topk_group=2, renormalize=True, scaling=2.5)
    _assert_same_choice(w, ids, want_w, want_ids)
    # the bias changes the choice (else this test could not tell it was read)
    _, unbiased = sigmoid_noaux_topk(logits, torch.zeros(16), 4, n_group=4, topk_group=2,
                                     renormalize=True)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


def _assert_same_choice(w, ids, want_w, want_ids) -> None:
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order).long(), want_ids.gather(1, want_order).long())
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order))
