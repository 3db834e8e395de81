"""``llmkit eval ppl``: the windows score every token once (sliding) or as llama-perplexity does
(llamacpp), and the perplexity from the engine's prompt logprobs equals Hugging Face's over the
same windows."""
from __future__ import annotations

import json
import math

import pytest
import torch

from llmkit.config.errors import ConfigError
from llmkit.entrypoints.cli import main
from llmkit.tools.eval.perplexity import (DEFAULT_TEXT, adds_bos, llamacpp_windows, make_windows,
                                    perplexity, sliding_windows)
from helpers.tiny_models import CORPUS


@pytest.mark.parametrize("n,window,stride", [(100, 32, 16), (100, 32, 32), (100, 32, 7),
                                             (31, 32, 16), (2, 8, 4), (65, 16, 1)])
def test_sliding_windows_score_every_token_after_the_first_once(n, window, stride):
    """(With stride == window the windows do not overlap, and each window's first token has no
    context to be scored from, as in Hugging Face's recipe.)"""
    ids = list(range(1000, 1000 + n))
    scored = []
    for w in sliding_windows(ids, window, stride):
        assert len(w.prompt) <= window and w.first_scored >= 1
        scored += w.prompt[w.first_scored:]
    assert scored == [t for i, t in enumerate(ids) if i > 0 and not (stride == window and i % window == 0)]


def test_llamacpp_windows_are_chunks_with_their_second_half_scored():
    ids = list(range(100, 1100))  # 1000 tokens, window 256: 3 whole chunks, the rest dropped
    windows = llamacpp_windows(ids, 256, bos_token_id=None)
    assert [w.prompt for w in windows] == [ids[0:256], ids[256:512], ids[512:768]]
    assert all(w.first_scored == 129 for w in windows)  # llama-perplexity: n_ctx - 1 - n_ctx/2
    assert sum(len(w.prompt) - w.first_scored for w in windows) == 3 * 127
    with_bos = llamacpp_windows(ids, 256, bos_token_id=7)
    assert [w.prompt[0] for w in with_bos] == [7, 7, 7] and with_bos[1].prompt[1:] == ids[257:512]


def test_window_settings_are_checked():
    with pytest.raises(ConfigError, match="eval.stride"):
        make_windows([1, 2, 3], window=2, stride=1, mode="llamacpp", bos_token_id=None)
    with pytest.raises(ConfigError, match="eval.stride"):
        make_windows([1, 2, 3], window=2, stride=3, mode="sliding", bos_token_id=None)
    with pytest.raises(ConfigError, match="eval.window"):
        make_windows([1, 2, 3], window=8, stride=None, mode="llamacpp", bos_token_id=None)


def hf_perplexity(model_dir, windows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w.prompt])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            for pos in range(w.first_scored, len(w.prompt)):
                nll -= lp[pos - 1, w.prompt[pos]].item()
                count += 1
    return math.exp(nll / count), count


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from llmkit.engine.llm import LLM

    model_dir = tiny_model_dir("llama")
    return model_dir, LLM(str(model_dir), dtype="float32", kv_cache={"block_size": 8})


@pytest.mark.parametrize("mode,window,stride", [("sliding", 64, 24), ("llamacpp", 48, None)])
def test_perplexity_equals_hugging_faces(tiny, mode, window, stride):
    model_dir, llm = tiny
    tok = llm.get_tokenizer()
    ids = tok(CORPUS).input_ids
    windows = make_windows(ids, window=window, stride=stride, mode=mode, bos_token_id=adds_bos(tok))
    result = perplexity(llm, windows)
    ppl, count = hf_perplexity(model_dir, windows)
    assert result.tokens == count
    assert result.ppl == pytest.approx(ppl, rel=1e-4)
    assert result.ppl == pytest.approx(math.exp(result.nll), rel=1e-12)


def test_cli_prints_json(tiny, tmp_path, capsys):
    model_dir, llm = tiny
    text = tmp_path / "text.txt"
    text.write_text(CORPUS[:1500])
    assert main(["eval", "ppl", str(model_dir), f"eval.text_file={text}", "eval.window=64",
                 "eval.mode=llamacpp", "model.dtype=float32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"ppl", "tokens", "nll"}
    tok = llm.get_tokenizer()
    windows = make_windows(tok(CORPUS[:1500]).input_ids, window=64, stride=None, mode="llamacpp",
                           bos_token_id=adds_bos(tok))
    expected = perplexity(llm, windows)
    assert out["tokens"] == expected.tokens and out["ppl"] == pytest.approx(expected.ppl, rel=1e-6)


def test_cli_errors(tiny, tmp_path, capsys):
    model_dir, _ = tiny
    assert main(["eval", "ppl", str(model_dir), f"eval.text_file={tmp_path / 'missing.txt'}"]) == 2
    assert "eval.text_file" in capsys.readouterr().err
    assert main(["eval", "ppl", str(model_dir), "eval.mode=llamacpp", "eval.stride=4"]) == 2
    assert "eval.stride" in capsys.readouterr().err
    assert main(["eval", "ppl", str(model_dir), "eval.mode=bogus"]) == 2
    assert "eval.mode" in capsys.readouterr().err


def test_the_shipped_text_is_there():
    text = DEFAULT_TEXT.read_text(encoding="utf-8")
    assert text.startswith("In Congress, July 4, 1776.") and len(text) > 4000
