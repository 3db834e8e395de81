"""Beam search (``LLM.beam_search``, ``llmkit.engine.beam_search``): with ``ignore_eos`` the
beams equal Hugging Face's ``generate(num_beams=k, do_sample=False)`` (float32, tiny random
Llama); vLLM's EOS rule and score, where they differ from HF's, against a reference loop over
HF's logprobs; the prompt's KV blocks are prefix-cache hits for every beam after the first."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmkit import LLM
from llmkit.engine.beam_search import BeamSearch, BeamSearchParams, get_beam_search_score
from llmkit.outputs import Logprob

BLOCK = 8
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(str(model_dir), dtype="float32", kv_cache={"block_size": BLOCK})
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (19, 6, 11)]
    return hf, llm, prompts


def hf_beams(hf, prompt: list[int], k: int, length_penalty: float) -> list[list[int]]:
    """HF's beams, best first, with no EOS reachable (``ignore_eos``)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long),
                          num_beams=k, num_return_sequences=k, do_sample=False,
                          max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                          early_stopping=False, eos_token_id=None, pad_token_id=0)
    return out.tolist()


@pytest.mark.parametrize("k,length_penalty", [(1, 1.0), (2, 0.5), (3, 1.0), (4, 2.0)])
def test_ignore_eos_equals_hf_generate_num_beams(setup, k, length_penalty):
    hf, llm, prompts = setup
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        got = [s.tokens for s in out.sequences]
        assert got == hf_beams(hf, prompt, k, length_penalty)  # the beams and their order
        for s in out.sequences:
            assert s.finish_reason == "length" and len(s.logprobs) == MAX_TOKENS
            assert s.cum_logprob == pytest.approx(
                sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(prompt):])))
            assert s.text == llm.get_tokenizer().decode(s.tokens)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # every step request gave its blocks back


def test_text_prompt_is_tokenized_as_generate_does(setup):
    _, llm, _ = setup
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.generate(text, None, use_tqdm=False)[0].prompt_token_ids
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    by_text = llm.beam_search(text, params)[0].sequences
    by_ids = llm.beam_search({"prompt_token_ids": ids}, params)[0].sequences
    assert [s.tokens for s in by_text] == [s.tokens for s in by_ids]
    assert by_text[0].tokens[:len(ids)] == ids


def test_beams_share_the_prompts_blocks_through_the_prefix_cache(setup, tiny_model_dir):
    _, llm, prompts = setup
    prompt, k = prompts[0], 4  # 19 tokens: two full blocks of 8
    before = llm.engine.stats()
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.beam_search({"prompt_token_ids": prompt}, params)[0]
    after = llm.engine.stats()
    # step 1: one request; then k per step, each re-submitting prompt + its beam
    num_requests = 1 + (MAX_TOKENS - 1) * k
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    full_prompt_blocks = len(prompt) // BLOCK
    assert full_prompt_blocks == 2
    # every request after the first finds at least the prompt's full blocks cached
    assert hits >= (num_requests - 1) * full_prompt_blocks * BLOCK
    # the same search without the prefix cache (every prefix recomputed) finds the same beams
    plain = LLM(str(tiny_model_dir("llama")), dtype="float32",
                kv_cache={"block_size": BLOCK, "enable_prefix_caching": False})
    try:
        again = plain.beam_search({"prompt_token_ids": prompt}, params)[0]
        assert plain.engine.stats().prefix_cache_hits == 0
    finally:
        plain.shutdown()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]


# -- vLLM's EOS rule and score, where they differ from HF's -----------------------------------

def reference_vllm_beam_search(hf, prompt: list[int], k: int, max_tokens: int, eos: int,
                               length_penalty: float) -> list[tuple[list[int], float, str]]:
    """vLLM's ``LLM.beam_search`` loop written plainly over HF's float32 logprobs: the top 2k
    candidates of each beam; an EOS candidate of any rank completes; score = cum / (prompt +
    generated tokens, a final EOS not counted) ** length_penalty."""
    def score(tokens, cum):
        n = len(tokens) - (tokens[-1] == eos)
        return cum / n ** length_penalty

    beams, completed = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        new = []
        for tokens, cum in beams:
            with torch.inference_mode():
                row = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = row.topk(2 * k)
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                (completed if t == eos else new).append((tokens + [t], cum + lp))
        beams = sorted(new, key=lambda b: score(*b), reverse=True)[:k]
    ranked = sorted(completed + beams, key=lambda b: score(*b), reverse=True)[:k]
    return [(t, c, "stop" if t[-1] == eos else "length") for t, c in ranked]


def test_eos_of_any_candidate_rank_completes_a_beam_as_in_vllm(setup, tiny_model_dir):
    hf, _, prompts = setup
    prompt, k = prompts[1], 2
    with torch.inference_mode():
        row = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    # EOS: the first step's 3rd candidate, outside the top k (HF would not finish that beam)
    eos = row.topk(2 * k).indices[2].item()
    llm = LLM(str(tiny_model_dir("llama", eos_token_id=eos)), dtype="float32",
              kv_cache={"block_size": BLOCK})
    try:
        assert llm.engine.model_facts.eos_token_id == eos
        for length_penalty in (1.0, 0.0):
            ref = reference_vllm_beam_search(hf, prompt, k, MAX_TOKENS, eos, length_penalty)
            params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS,
                                      length_penalty=length_penalty)
            got = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
            assert [(s.tokens, s.finish_reason) for s in got] == [(t, f) for t, _, f in ref]
            assert [s.cum_logprob for s in got] == pytest.approx([c for _, c, _ in ref],
                                                                 abs=1e-4)
        # with length_penalty=0 the score is the cumulative logprob: the one-token beam that
        # ended in EOS at rank 3 is the best of all
        assert got[0].tokens == prompt + [eos] and got[0].finish_reason == "stop"
        assert got[0].stop_reason == eos
    finally:
        llm.shutdown()


def lp(v: float) -> Logprob:
    return Logprob(v)


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert get_beam_search_score([1, 2, 3, 9], -3.0, 9, 1.0) == pytest.approx(-1.0)
    assert get_beam_search_score([1, 2, 3, 9], -3.0, 9, 2.0) == pytest.approx(-3.0 / 9)
    assert get_beam_search_score([1, 2, 3, 4], -3.0, 9, 1.0) == pytest.approx(-0.75)


def test_beam_bookkeeping_by_hand():
    """Width 2, EOS 9: EOS candidates complete wherever they rank; the live beams are the best
    non-EOS candidates; the result mixes completed and live beams by score."""
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    s = BeamSearch([1, 2, 3], params, eos_token_id=9)
    assert s.prompts() == [[1, 2, 3]]
    s.advance([{5: lp(-0.1), 6: lp(-0.5), 7: lp(-2.0), 9: lp(-0.45)}])
    assert s.prompts() == [[1, 2, 3, 5], [1, 2, 3, 6]]
    assert [(b.tokens, b.cum_logprob) for b in s.completed] == [([1, 2, 3, 9], -0.45)]
    s.advance([{5: lp(-2.0), 9: lp(-2.5), 6: lp(-3.0), 7: lp(-4.0)},
               {7: lp(-0.2), 8: lp(-1.0), 5: lp(-3.0), 6: lp(-3.5)}])
    assert s.done
    assert [b.tokens for b in s.beams] == [[1, 2, 3, 6, 7], [1, 2, 3, 6, 8]]
    best = s.best()
    # scores: [..6,7] -0.7/5 = -0.14; [1,2,3,9] -0.45/3 = -0.15; [..6,8] -1.5/5; [..5,9] -2.6/4
    # (by cumulative logprob alone the EOS beam would come first)
    assert [b.tokens for b in best] == [[1, 2, 3, 6, 7], [1, 2, 3, 9]]
    assert [b.finish_reason for b in best] == [None, "stop"]
    # ignore_eos: the EOS candidate is a live beam like any other
    s = BeamSearch([1, 2, 3], BeamSearchParams(2, 1, ignore_eos=True), eos_token_id=9)
    s.advance([{5: lp(-0.1), 9: lp(-0.3), 6: lp(-0.5), 7: lp(-2.0)}])
    assert [b.tokens for b in s.best()] == [[1, 2, 3, 5], [1, 2, 3, 9]] and not s.completed


def test_request_output_leaves_the_eos_out_of_the_text(tiny_tokenizer):
    s = BeamSearch([1, 2], BeamSearchParams(2, 1), eos_token_id=7)
    s.advance([{7: lp(-0.1), 40: lp(-0.2), 41: lp(-0.3)}])
    ro = s.request_output("r", tiny_tokenizer)
    assert ro.finished and ro.prompt_token_ids == [1, 2]
    first, second = ro.outputs
    assert (first.index, first.token_ids, first.finish_reason, first.stop_reason) == (
        0, [], "stop", 7)
    assert first.text == ""
    assert (second.token_ids, second.finish_reason) == ([40], "length")
    assert second.text == tiny_tokenizer.decode([40])
    kept = BeamSearch([1, 2], BeamSearchParams(2, 1, include_stop_str_in_output=True), 7)
    kept.advance([{7: lp(-0.1), 40: lp(-0.2), 41: lp(-0.3)}])
    assert kept.request_output("r", tiny_tokenizer).outputs[0].token_ids == [7]


@pytest.mark.parametrize("kwargs,field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": True, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}:"):
        BeamSearchParams(**kwargs)


def test_bad_prompts_and_lengths_are_value_errors(setup):
    _, llm, _ = setup
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search({"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match="BeamSearchParams.max_tokens"):
        llm.beam_search([5] * 10, BeamSearchParams(2, llm.max_model_len - 5))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([5] * 10, {"beam_width": 2})
