"""Perplexity of a model over a text file (``llmkit eval ppl``), from prompt logprobs.

The text is tokenized once (the tokenizer's own special tokens, as llama.cpp's tokenizer adds
them) and cut into windows; each window is one request whose prompt logprobs score some of its
positions, every scored token exactly once over the file:

- ``sliding`` (Hugging Face's strided perplexity): windows of ``window`` tokens starting every
  ``stride`` tokens; a window scores the tokens the previous one did not reach, so each token
  after the first has up to ``window - stride`` tokens of context.
- ``llamacpp`` (what ``llama-perplexity -c window`` computes): non-overlapping chunks of
  ``window`` tokens (a trailing partial chunk is dropped), the first token of each replaced by
  BOS when the tokenizer adds one, and only the second half scored: positions
  ``window/2 + 1 .. window - 1`` of each chunk.

``nll`` is the mean negative log-likelihood per scored token (nats), ``ppl = exp(nll)``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

from llmkit.config.errors import ConfigError
from llmkit.tools.schema import EvalToolConfig

#: The text ``llmkit eval ppl`` reads when ``eval.text_file`` is not set: the Declaration of
#: Independence (1776; a public-domain work), ~8 KB, ~1,700 tokens for SmolLM2.
DEFAULT_TEXT = Path(__file__).with_name("texts") / "declaration_of_independence.txt"


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """One request: ``prompt`` token ids, of which positions ``first_scored ..`` are scored."""

    prompt: list[int]
    first_scored: int


@dataclasses.dataclass(frozen=True, slots=True)
class PerplexityResult:
    ppl: float
    tokens: int
    nll: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def sliding_windows(ids: Sequence[int], window: int, stride: int) -> list[Window]:
    out: list[Window] = []
    prev_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        targets = end - prev_end
        out.append(Window(list(ids[begin:end]), max(1, (end - begin) - targets)))
        prev_end = end
        if end == len(ids):
            break
    return [w for w in out if w.first_scored < len(w.prompt)]


def llamacpp_windows(ids: Sequence[int], window: int, bos_token_id: int | None) -> list[Window]:
    out = []
    for start in range(0, len(ids) - window + 1, window):
        chunk = list(ids[start:start + window])
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        out.append(Window(chunk, window // 2 + 1))
    return out


def adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer("a").input_ids
    plain = tokenizer("a", add_special_tokens=False).input_ids
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


def check_settings(*, window: int, stride: int | None, mode: str) -> None:
    """The window settings' errors, before a model is loaded."""
    if mode == "llamacpp" and stride is not None:
        raise ConfigError("eval.stride", stride,
                          "null with eval.mode=llamacpp (its chunks never overlap)")
    if mode == "sliding" and stride is not None and not 1 <= stride <= window:
        raise ConfigError("eval.stride", stride, f"1..eval.window ({window}), or null")


def make_windows(ids: Sequence[int], *, window: int, stride: int | None, mode: str,
                 bos_token_id: int | None) -> list[Window]:
    check_settings(window=window, stride=stride, mode=mode)
    if mode == "llamacpp":
        windows = llamacpp_windows(ids, window, bos_token_id)
        if not windows:
            raise ConfigError("eval.window", window, f"at most the text's {len(ids)} tokens "
                              "(eval.mode=llamacpp scores whole windows only)")
        return windows
    return sliding_windows(ids, window, max(1, window // 2) if stride is None else stride)


def perplexity(llm, windows: Sequence[Window]) -> PerplexityResult:
    """Score ``windows`` with ``llm`` (an ``LLM``): one request each, all in one batch."""
    from llmkit.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([w.prompt for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for w, out in zip(windows, outputs):
        lps = out.prompt_logprobs
        for pos in range(w.first_scored, len(w.prompt)):
            nll -= lps[pos][w.prompt[pos]].logprob
            count += 1
    if count == 0:
        raise ConfigError("eval.text_file", None, "", message="the text has no token to score "
                          "(it needs at least 2 tokens)")
    mean = nll / count
    return PerplexityResult(ppl=math.exp(mean), tokens=count, nll=mean)


def run_eval_ppl(tool_config: EvalToolConfig) -> int:
    """``llmkit eval ppl``: prints the result as one JSON line."""
    from llmkit.engine.llm import LLM

    ev, config = tool_config.eval, tool_config.engine
    check_settings(window=ev.window, stride=ev.stride, mode=ev.mode)
    path = Path(ev.text_file) if ev.text_file else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("eval.text_file", str(path), f"a readable UTF-8 text file ({e.strerror})") from e
    max_len = config.model.max_model_len
    if max_len is not None and ev.window + 1 > max_len:
        raise ConfigError("eval.window", ev.window, f"at most model.max_model_len - 1 ({max_len - 1})")
    llm = LLM.from_config(config)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(text).input_ids
    windows = make_windows(ids, window=ev.window, stride=ev.stride, mode=ev.mode,
                           bos_token_id=adds_bos(tokenizer))
    print(perplexity(llm, windows).to_json())
    return 0
