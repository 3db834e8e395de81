"""Stop strings across token boundaries, min_tokens, bad words, and incremental detokenization
(byte-level BPE: streamed pieces never hold broken UTF-8)."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.engine.output_processor import IncrementalDetokenizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), dtype="float32")


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy continuation without stop strings, and each token's text."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    return out, [tok.decode([t]) for t in out.token_ids]


def assert_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def boundary_stop(reference) -> tuple[str, int, int]:
    """A stop string made of the end of token j and the start of token j + 1, that first
    occurs there: (string, j + 1, its index in the text)."""
    out, pieces = reference
    for j in range(1, len(pieces) - 1):
        a, b = pieces[j], pieces[j + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            at = len("".join(pieces[:j + 1])) - 2
            if out.text.find(stop) == at:
                return stop, j + 1, at
    pytest.fail("no usable token boundary in the reference output")


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)


def test_reference_text_is_the_concatenated_pieces(reference):
    out, pieces = reference
    assert out.text == "".join(pieces)  # so that boundary_stop's arithmetic holds


def test_stop_string_across_token_boundary_is_cut(llm, reference):
    stop, j, at = boundary_stop(reference)
    out = llm.generate([PROMPT], params(stop=["never-there", stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == reference[0].text[:at]
    assert c.token_ids == reference[0].token_ids[:j + 1]  # up to the token completing it
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert_blocks_free(llm)  # aborted in the core at once


def test_include_stop_str_in_output(llm, reference):
    stop, j, at = boundary_stop(reference)
    c = llm.generate([PROMPT], params(stop=stop, include_stop_str_in_output=True),
                     use_tqdm=False)[0].outputs[0]
    assert c.text == reference[0].text[:at + len(stop)]
    assert c.stop_reason == stop


def test_streaming_never_sends_text_it_must_take_back(llm, reference):
    stop, j, at = boundary_stop(reference)
    deltas = []
    for out in llm.stream(PROMPT, params(stop=[stop])):
        deltas.append(out.outputs[0].text)
        # Whatever was streamed is a prefix of the final text: no part of the stop string.
        assert reference[0].text[:at].startswith("".join(deltas))
        if out.finished:
            kv = llm.engine.kv_cache_manager
            assert kv.num_free_blocks == kv.num_blocks  # freed before the output arrived
    assert "".join(deltas) == reference[0].text[:at]


def test_stop_string_with_other_requests_running(llm, reference):
    stop, j, at = boundary_stop(reference)
    outs = llm.generate([PROMPT, "Hello there", PROMPT],
                        [params(stop=[stop]), params(), params(stop=[stop])], use_tqdm=False)
    assert outs[0].outputs[0].text == outs[2].outputs[0].text == reference[0].text[:at]
    assert outs[1].outputs[0].finish_reason == "length"
    assert_blocks_free(llm)


def test_min_tokens_delays_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    force_eos = {eos: 100.0}  # EOS is the argmax at every step
    now = llm.generate([PROMPT], SamplingParams(temperature=0, logit_bias=force_eos),
                       use_tqdm=False)[0].outputs[0]
    assert now.token_ids == [eos] and now.finish_reason == "stop"
    later = llm.generate([PROMPT], SamplingParams(temperature=0, logit_bias=force_eos,
                                                  min_tokens=5),
                         use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) == 6 and later.token_ids[-1] == eos
    assert eos not in later.token_ids[:5]
    # The same for stop_token_ids, and at temperature 1 (the mask applies to every row kind).
    stop_id = later.token_ids[2]
    sampled = llm.generate([PROMPT] * 4, SamplingParams(
        temperature=1.0, seed=5, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id],
        min_tokens=3, ignore_eos=True), use_tqdm=False)
    for out in sampled:
        c = out.outputs[0]
        assert len(c.token_ids) == 4 and c.stop_reason == stop_id


def test_bad_words_never_appear(llm, reference):
    tok = llm.get_tokenizer()
    out, pieces = reference
    # Two words the model says greedily, both pushed hard by a logit bias as well.
    word1 = next(p.strip() for p in pieces if len(p.strip()) >= 2 and "\ufffd" not in p)
    word2 = "quick brown"
    banned_seqs = [tok.encode(w, add_special_tokens=False) for w in
                   (word1, " " + word1, word2, " " + word2)]
    bias = {t: 8.0 for seq in banned_seqs for t in seq}
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=bias,
                        bad_words=[word1, word2])
    unrestricted = llm.generate([PROMPT], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, logit_bias=bias),
        use_tqdm=False)[0].outputs[0]
    got = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]

    def contains(ids, seq):
        return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))

    assert any(contains(unrestricted.token_ids, s) for s in banned_seqs)  # the test can fail
    assert not any(contains(got.token_ids, s) for s in banned_seqs)
    sampled = llm.generate([PROMPT] * 3, SamplingParams(
        temperature=1.0, seed=1, max_tokens=40, ignore_eos=True, logit_bias=bias,
        bad_words=[word1, word2]), use_tqdm=False)
    for o in sampled:
        assert not any(contains(o.outputs[0].token_ids, s) for s in banned_seqs)


@pytest.mark.parametrize("text", ["naïve café", "日本語のテキスト", "emoji 🙂🚀 end",
                                  "mixed Ωμέγα and ascii"])
def test_incremental_detokenization_never_splits_a_character(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("Hello"))
    pieces = [detok.add_token(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tiny_tokenizer.decode(ids) == text


def test_streamed_text_equals_final_text(llm):
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    final = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    streamed = "".join(o.outputs[0].text for o in llm.stream(PROMPT, sp))
    assert streamed == final.text
    assert final.text == llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
