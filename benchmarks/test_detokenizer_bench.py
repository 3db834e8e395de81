"""Detokenization of a streamed output: llmkit's ``IncrementalDetokenizer`` (DecodeStream, one
token at a time) next to the naive way (decode the whole output again after every token), and
``TokenTexts`` (each token's own text, for logprobs), in one group so they compare as ratios.

The tokenizer is the tests' byte-level BPE (tests/helpers/tiny_models.py); the text mixes English
with multi-byte characters so that some tokens end mid-character. 512 output tokens per run.

Run: ``pytest benchmarks/test_detokenizer_bench.py --benchmark-only``.
"""
from __future__ import annotations


import pytest

from helpers.tiny_models import CORPUS, build_tokenizer

from llmkit.engine.output_processor import IncrementalDetokenizer, TokenTexts  # noqa: E402

N_TOKENS = 512


@pytest.fixture(scope="module")
def stream():
    tok = build_tokenizer()
    text = (CORPUS + " naïve café — 日本語のテキスト 😀 ") * 8
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > N_TOKENS + 16
    return tok, ids[:16], ids[16:16 + N_TOKENS]


@pytest.mark.benchmark(group="detokenizer")
def test_incremental_detokenizer(benchmark, stream):
    tok, prompt, output = stream

    def run():
        d = IncrementalDetokenizer(tok, prompt)
        for t in output:
            d.add_token(t)
        return d.text

    text = benchmark(run)
    assert text == tok.decode(output)


@pytest.mark.benchmark(group="detokenizer")
def test_naive_full_decode_each_token(benchmark, stream):
    tok, _, output = stream

    def run():
        text = ""
        for i in range(1, len(output) + 1):
            text = tok.decode(output[:i])
        return text

    assert benchmark.pedantic(run, rounds=3, iterations=1) == tok.decode(output)


@pytest.mark.benchmark(group="detokenizer")
def test_token_texts_for_logprobs(benchmark, stream):
    tok, _, output = stream

    def run():
        texts = TokenTexts(tok)
        return [texts(t) for t in output]

    assert len(benchmark(run)) == len(output)
