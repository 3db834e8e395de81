"""The one input processor of ``LLM`` and ``AsyncLLM`` (``InputProcessor`` in
``llmkit/engine/frontend.py``): the same prompt and parameters are valid for both or for
neither."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.engine.frontend import InputProcessor
from llmkit.facts import ModelFacts

VOCAB = 100


class Tok:
    """Encodes each character as its code modulo the vocabulary (bad words: one id per char)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]


@pytest.fixture
def proc() -> InputProcessor:
    facts = ModelFacts(max_model_len=8, vocab_size=VOCAB, eos_token_id=2, eos_token_ids=(2, 7))
    return InputProcessor(Tok(), facts)


@pytest.mark.parametrize("ids,ok", [([0, 5, VOCAB - 1], True), ([5, VOCAB], False),
                                    ([-1, 5], False), ([5, 10**9], False)])
def test_prompt_ids_must_lie_in_the_vocabulary(proc, ids, ok):
    if ok:
        assert proc.process(ids, SamplingParams()).token_ids == ids
    else:
        with pytest.raises(ValueError, match=rf"prompt: token id {ids[-1] if ids[0] >= 0 else -1}"
                                             rf" is out of range \(the vocabulary has 100"):
            proc.process(ids, SamplingParams())


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {VOCAB: 1.0}), ("allowed_token_ids", [3, VOCAB]),
    ("stop_token_ids", [VOCAB + 5])])
def test_parameter_ids_must_lie_in_the_vocabulary(proc, field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}: token id \d+ is out of range"):
        proc.process([5], SamplingParams(**{field: value}))
    last = {"logit_bias": {VOCAB - 1: 1.0}}.get(field, [VOCAB - 1])
    proc.process([5], SamplingParams(**{field: last}))  # the last id is fine


def test_logprob_bounds_lengths_and_types(proc):
    proc.process([5], SamplingParams(logprobs=VOCAB, prompt_logprobs=VOCAB))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}: at most the vocabulary"):
            proc.process([5], SamplingParams(**{field: VOCAB + 1}))
    assert len(proc.process([1] * 8, SamplingParams()).token_ids) == 8
    with pytest.raises(ValueError, match=r"9 tokens, .*maximum context length "
                                         r"\(model.max_model_len=8\)"):
        proc.process([1] * 9, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        proc.process([], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        proc.process("", SamplingParams())
    with pytest.raises(TypeError, match="prompt must be"):
        proc.process([1, True], SamplingParams())
    with pytest.raises(TypeError, match="prompt must be"):
        proc.process(3, SamplingParams())


def test_params_are_completed_and_dict_prompts_carry_their_salt(proc):
    p = proc.process({"prompt": "ab", "cache_salt": "tenant-1"},
                     SamplingParams(stop_token_ids=[4], bad_words=["c"]))
    assert (p.text, p.token_ids, p.cache_salt) == ("ab", [97, 98], "tenant-1")
    assert p.params.stop_token_ids == [4, 7]  # the model's second EOS id stops too
    assert p.params.bad_words_token_ids == [[99], [32, 99]]  # "c" and " c"
    req = p.to_request("r", eos_token_id=2, arrival_time=0.0)
    assert (req.prompt_token_ids, req.cache_salt) == ([97, 98], "tenant-1")
    q = proc.process({"prompt_token_ids": [3, 4]}, SamplingParams(), cache_salt="x")
    assert (q.text, q.token_ids, q.cache_salt) == (None, [3, 4], "x")
    with pytest.raises(ValueError, match="exactly one"):
        proc.process({"prompt": "a", "prompt_token_ids": [1]}, SamplingParams())


def test_llm_refuses_what_asyncllm_refuses(tiny_model_dir):
    """The offline API checks prompt ids too (it let them through to the engine's step)."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    vocab = llm.engine.model_facts.vocab_size
    with pytest.raises(ValueError, match=f"prompt: token id {vocab} is out of range"):
        llm.generate([[5, vocab]], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        llm.generate([[5]], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    out = llm.generate([[5, vocab - 1]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.shutdown()
