"""Reasoning parsers (``server.reasoning_parser``) on texts and on streams of deltas, with
markers split across deltas: the streamed pieces must join to the one-shot split, which must
be vLLM's (deepseek_r1: text before ``</think>`` is thinking even without ``<think>``; qwen3:
thinking needs ``<think>``); and the engine side: an output constraint waits for the end
marker's tokens (the thinking is free, the answer follows the grammar)."""
from __future__ import annotations

import random

import pytest

from llmkit.config.errors import ConfigError
from llmkit.entrypoints.openai.reasoning import REASONING_PARSERS, check_reasoning_parser

DS = REASONING_PARSERS.get("deepseek_r1")()
QW = REASONING_PARSERS.get("qwen3")()


@pytest.mark.parametrize("parser,text,reasoning,content", [
    (DS, "<think>abc</think>answer", "abc", "answer"),
    (DS, "abc</think>answer", "abc", "answer"),  # R1's template opens <think> in the prompt
    (DS, "abc", "abc", None),  # cut off while thinking
    (DS, "<think>abc</think>", "abc", None),
    (DS, "<think></think>\n\nx", "", "\n\nx"),
    (DS, "<thi", "<thi", None),  # a partial marker at the end is thinking
    (QW, "<think>\nabc\n</think>\n\nanswer", "\nabc\n", "\n\nanswer"),
    (QW, "abc</think>answer", None, "abc</think>answer"),  # no <think>: all answer
    (QW, "plain answer", None, "plain answer"),
    (QW, "<think>abc", "abc", None),
    (QW, "<thi", None, "<thi"),
    (QW, "", None, None),
])
def test_split(parser, text, reasoning, content):
    got = parser.split(text)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize("prompt,state", [
    ("<|im_start|>assistant\n", "start"),
    ("<|im_start|>assistant\n<think>\n", "thinking"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "answer"),  # enable_thinking=false
    ("a <think>x</think> b <think>", "thinking"),
])
def test_the_prompt_decides_where_the_output_starts(prompt, state):
    assert QW.initial_state(prompt) == DS.initial_state(prompt) == state


def test_prompt_state_changes_the_split():
    assert QW.split("abc</think>x", "thinking").reasoning == "abc"
    assert QW.split("abc</think>x", "thinking").content == "x"
    assert DS.split("abc</think>x", "answer").reasoning is None
    assert DS.split("abc</think>x", "answer").content == "abc</think>x"


TEXTS = ["<think>I think, so</think>The answer is 42.",
         "step one < two </thinking? no</think> done <think>literal",
         "</think>",
         "<think><think></think></think>",
         "no thinking here at all < > </ </t",
         "<think>cut off mid </thi"]


@pytest.mark.parametrize("parser", [DS, QW], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("state", ["start", "thinking", "answer"])
def test_streamed_deltas_join_to_the_split(parser, text, state):
    rng = random.Random(hash((text, state)) & 0xFFFF)
    whole = parser.split(text, state)
    for trial in range(30):
        # random cuts, including every single-character split of the markers
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))) \
            if trial else list(range(1, len(text)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = parser.streamer(state)
        reasoning, content = "", ""
        for p in pieces:
            r, c = s.feed(p)
            reasoning, content = reasoning + r, content + c
        r, c = s.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning if s.entered_thinking else None) == whole.reasoning, pieces
        assert (content or None) == whole.content, pieces


def test_markers_split_across_deltas_are_never_sent_as_text():
    s = QW.streamer()
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>hm") == ("hm", "")
    assert s.feed("m</th") == ("m", "")
    assert s.feed("ink") == ("", "")
    assert s.feed(">ok") == ("", "ok")
    assert s.finish() == ("", "")


def test_unknown_parser_is_a_config_error_naming_the_key():
    check_reasoning_parser("none")
    check_reasoning_parser("qwen3")
    with pytest.raises(ConfigError, match=r"server\.reasoning_parser: got 'nope'.*deepseek_r1"):
        check_reasoning_parser("nope")


# --------------------------------------------------------------------------- the engine side

class _Grammar:
    """Accepts only the token ids of ``allowed`` in order (a stand-in matcher)."""

    def __init__(self, allowed):
        self.allowed, self.pos = list(allowed), 0

    def accept_tokens(self, tokens):
        for t in tokens:
            if self.pos >= len(self.allowed) or self.allowed[self.pos] != t:
                return False
            self.pos += 1
        return True

    def rollback(self, n):
        self.pos -= n

    def is_terminated(self):
        return self.pos == len(self.allowed)

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if not self.is_terminated():
            t = self.allowed[self.pos]
            bitmask[row, t // 32] = 1 << (t % 32)


def _request(end):
    from types import SimpleNamespace

    from llmkit.structured_output.request import StructuredOutputRequest

    so = StructuredOutputRequest(("k", ""), None, grammar=_Grammar([7, 8]),
                                 reasoning_end=tuple(end))
    return SimpleNamespace(structured_output_request=so, num_computed_tokens=1, num_tokens=1)


def test_the_grammar_waits_for_the_end_marker_tokens():
    from llmkit.structured_output.manager import StructuredOutputManager

    req = _request([5, 6])
    mgr = StructuredOutputManager.__new__(StructuredOutputManager)
    # thinking: tokens the grammar would refuse pass by, a lone 5 or 6 does not end it
    assert mgr.accept_tokens(req, [1, 5, 2, 6, 5])
    assert req.structured_output_request.reasoning
    assert mgr.accept_tokens(req, [6, 7])  # the marker ends; 7 is the grammar's
    assert not req.structured_output_request.reasoning
    assert req.structured_output_request.grammar.pos == 1
    assert not mgr.accept_tokens(req, [1])  # now the grammar decides


def test_bitmask_rows_are_free_while_thinking_and_constrained_after_a_draft_ends_it():
    import numpy as np

    from llmkit.structured_output.base import StructuredOutputBackend
    from llmkit.structured_output.manager import StructuredOutputManager

    class Backend:
        vocab_size = 64
        allocate_bitmask = StructuredOutputBackend.allocate_bitmask
        fill_bitmasks = StructuredOutputBackend.fill_bitmasks

    mgr = StructuredOutputManager.__new__(StructuredOutputManager)
    from concurrent.futures import Future
    f = Future()
    f.set_result(Backend())
    mgr._backend_future = f
    req = _request([5, 6])
    # no drafts: one free row
    _, bm = mgr.grammar_bitmask({"r": req}, ["r"])
    assert (bm == -1).all()
    # drafts 5, 6 (the marker), 7: rows 0-2 free... row 2 follows the marker: constrained
    _, bm = mgr.grammar_bitmask({"r": req}, ["r"], {"r": [5, 6, 7]})
    assert (bm[:2] == -1).all()
    assert bm[2, 0] == 1 << 7 and bm[3, 0] == 1 << 8
    assert req.structured_output_request.reasoning  # nothing consumed
    assert req.structured_output_request.grammar.pos == 0
