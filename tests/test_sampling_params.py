"""SamplingParams: vLLM's fields and defaults, validation naming the field, JSON-style inputs."""
from __future__ import annotations

import dataclasses

import pytest

from llmkit.sampling import SamplingParams
from llmkit.sampling.bad_words import banned_next_tokens, tokenize_bad_words
from llmkit.engine.output_processor import ParentRequest, child_params
from llmkit.sampling.params import RequestOutputKind
from llmkit.sampling.stop_strings import find_stop_string, holdback_chars

# vLLM's SamplingParams defaults for every field the issue lists.
VLLM_DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, allowed_token_ids=None,
    bad_words=None, stop=[], stop_token_ids=[], include_stop_str_in_output=False,
    ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None,
    seed=None, skip_special_tokens=True, spaces_between_special_tokens=True,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert {k: getattr(p, k) for k in VLLM_DEFAULTS} == VLLM_DEFAULTS


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1),
    ("min_p", 1.1), ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("prompt_logprobs", -2),
    ("seed", 1.5), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("bad_words", [" "]), ("logit_bias", {"x": 1.0}), ("logit_bias", {3: "a"}),
    ("logit_bias", [1, 2]), ("allowed_token_ids", []), ("allowed_token_ids", [-3]),
])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", logit_bias={"7": 250, 9: -300, 11: 0.5},
                       allowed_token_ids=(3, 4))
    assert p.top_k == 0 and p.stop == ["###"]
    assert p.logit_bias == {7: 100.0, 9: -100.0, 11: 0.5}  # JSON keys; clamped like OpenAI
    assert p.allowed_token_ids == [3, 4]
    assert SamplingParams(n=3).n == 3  # n > 1 is supported
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert not SamplingParams().has_penalties


def test_child_params_derive_seeds_and_keep_prompt_logprobs_on_child_zero():
    p = SamplingParams(n=3, seed=10, prompt_logprobs=2, temperature=0.7)
    kids = [child_params(p, i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert [k.prompt_logprobs for k in kids] == [2, None, None]
    assert all(k.n == 1 and k.temperature == 0.7 for k in kids)
    assert child_params(dataclasses.replace(p, seed=None), 1).seed is None
    parent = ParentRequest("r", None, [1], p, RequestOutputKind.FINAL_ONLY)
    assert parent.child_ids == ["0_r", "1_r", "2_r"]
    single = ParentRequest("r", None, [1], SamplingParams(), RequestOutputKind.FINAL_ONLY)
    assert single.child_ids == ["r"]


def test_find_stop_string_across_pieces():
    # "STOP" arrives as "ST" + "OP": only the second piece completes it.
    assert find_stop_string("abcST", 2, ["STOP"], False) is None
    assert find_stop_string("abcSTOP", 2, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOPxy", 4, ["STOP"], True) == ("STOP", 7)
    # Old text is not searched again; the earliest match wins.
    assert find_stop_string("STOP and more", 4, ["STOP"], False) is None
    assert find_stop_string("xx-ab-", 4, ["b-", "-a"], False) == ("-a", 2)
    assert holdback_chars(["ab", "abcd"], False) == 3
    assert holdback_chars(["ab", "abcd"], True) == 0 and holdback_chars([], False) == 0


def test_bad_words_tokenization_and_matching(tiny_tokenizer):
    words = tokenize_bad_words(["fox", "quick brown"], tiny_tokenizer)
    enc = lambda s: tiny_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("fox") in words and enc(" fox") in words
    assert enc("quick brown") in words and enc(" quick brown") in words
    multi = enc(" quick brown")
    assert len(multi) >= 2
    assert banned_next_tokens([multi], [1, 2]) == []
    assert banned_next_tokens([multi], [1, 2] + multi[:-1]) == [multi[-1]]
    assert banned_next_tokens([[42]], []) == [42]
