"""`llmkit chat`'s loop driven in-process with scripted lines: its commands (/help, /quit,
/exit, /stats, /reset, unknown ones), empty lines, Ctrl-D, and `generate`'s speculation line.
The terminal path itself (a subprocess) is tested in test_cli.py."""
from __future__ import annotations

import contextlib
import io
import re
from types import SimpleNamespace

import pytest

from llmkit import LLM
from llmkit.config.compose import build_config
from llmkit.entrypoints.chat_commands import parse_command
from llmkit.entrypoints.offline import run_generate, sampling_params_from
from llmkit.entrypoints.reply_stats import ReplyMeter, spec_decode_line
from llmkit.scheduler.base import SpecDecodeStats
from llmkit.entrypoints.terminal_chat import ChatIO, run_chat_loop

NGRAM = {"name": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# repeats itself, so n-gram lookup finds drafts in the prompt
REPEATING = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"


def script(*lines: str) -> tuple[ChatIO, list[str]]:
    """A ChatIO that reads ``lines`` then Ctrl-D (EOFError); records the prompts shown."""
    prompts: list[str] = []
    pending = list(lines)

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not pending:
            raise EOFError
        return pending.pop(0)

    return ChatIO(read_line=read_line, out=io.StringIO(), err=io.StringIO()), prompts


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def chat_llm(model_dir):
    return LLM(str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def chat_config(model_dir):
    return build_config(str(model_dir), overrides=["model.dtype=float32", "chat.max_tokens=6",
                                                   "sampling.temperature=0"])


def chat(llm, config, *lines: str) -> tuple[str, str, list[str], int]:
    chat_io, prompts = script(*lines)
    code = run_chat_loop(llm, config, sampling_params_from(config), io=chat_io)
    return chat_io.out.getvalue(), chat_io.err.getvalue(), prompts, code


def test_parse_command_tells_commands_from_messages():
    assert parse_command("/help").name == "/help" and parse_command(" /HELP ").known
    assert parse_command("/exit") == parse_command("/quit")
    assert parse_command("/stats please").name == "/stats"
    unknown = parse_command("/frobnicate now")
    assert unknown.name == "/frobnicate" and not unknown.known
    # paths, a bare slash and ordinary text are messages
    for line in ("/usr/bin is a folder", "/", "what does /help do?", "hello"):
        assert parse_command(line) is None, line


@contextlib.contextmanager
def recording(llm):
    """The prompts (decoded) that the chat sends to ``llm``."""
    sent: list[str] = []
    real_stream = llm.stream

    def stream(prompt, params, **kw):
        sent.append(llm.tokenizer.decode(prompt))
        yield from real_stream(prompt, params, **kw)

    llm.stream = stream
    try:
        yield sent
    finally:
        del llm.stream


def test_commands_are_never_sent_to_the_model(chat_llm, chat_config):
    with recording(chat_llm) as sent:
        out, err, prompts, code = chat(chat_llm, chat_config, "/help", "", "   ", "hi there",
                                       "/frobnicate", "/stats", "/reset", "/exit", "never")
    assert code == 0
    # one reply; /exit ended the chat before "never" was read
    assert len(sent) == 1 and "hi there" in sent[0] and "/help" not in sent[0]
    assert len(prompts) == 8 and out.count("\n") == 1
    assert "/help for commands, /quit or Ctrl-D to quit" in err
    for name in ("/help", "/stats", "/reset", "/quit"):
        assert re.search(rf"^  {re.escape(name)} ", err, re.M), name
    assert "[unknown command /frobnicate; /help lists the commands]" in err
    assert "[conversation forgotten" in err
    speed = re.search(r"\[speed: last reply ([\d.]+) tok/s \((\d+) tokens in [\d.]+ s\); "
                      r"overall ([\d.]+) tok/s over 1 reply\]", err)
    assert speed and 1 <= int(speed.group(2)) <= 6 and speed.group(1) == speed.group(3)
    tokens = re.search(r"\[tokens: (\d+) in .*, (\d+) out\]", err)
    assert int(tokens.group(1)) > 2 and tokens.group(2) == speed.group(2)
    assert "[speculative decoding: off" in err


def test_empty_lines_keep_the_conversation_and_ctrl_d_quits(chat_llm, chat_config):
    with recording(chat_llm) as sent:
        out, err, prompts, code = chat(chat_llm, chat_config, "first", "", "second")
    assert code == 0 and len(prompts) == 4  # first, empty, second, then Ctrl-D
    assert out.count("\n") == 2 and len(sent) == 2  # two replies
    assert "first" in sent[1] and "second" in sent[1]  # the empty line kept the conversation
    assert err.endswith("\n\n")  # Ctrl-D ends the prompt's line


def test_stats_report_speculation_over_the_session(model_dir):
    config = build_config(str(model_dir), overrides=[
        "model.dtype=float32", "chat.max_tokens=12", "sampling.temperature=0",
        "speculative=ngram", "speculative.num_speculative_tokens=3",
        "speculative.prompt_lookup_min=1"])
    llm = LLM.from_config(config)
    before = llm.engine.stats().spec_decode.snapshot()
    _, err, _, _ = chat(llm, config, REPEATING, "/stats")
    counts = llm.engine.stats().spec_decode.snapshot().since(before)
    assert counts.num_draft_tokens > 0
    line = re.search(r"\[speculative decoding \(ngram, K=3\): acceptance rate ([\d.]+)% "
                     r"\((\d+) of (\d+) draft tokens\), mean acceptance length ([\d.]+) "
                     r"tokens per verify step\]", err)
    assert line, err
    assert (int(line.group(2)), int(line.group(3))) == (counts.num_accepted_tokens,
                                                        counts.num_draft_tokens)
    assert float(line.group(1)) == pytest.approx(100 * counts.acceptance_rate, abs=0.05)
    assert float(line.group(4)) == pytest.approx(counts.mean_acceptance_length, abs=0.005)
    llm.shutdown()


def test_generate_prints_the_acceptance_only_with_speculation(model_dir, capsys):
    base = ["model.dtype=float32", "sampling.max_tokens=12", "sampling.temperature=0"]
    spec = ["speculative=ngram", "speculative.num_speculative_tokens=3",
            "speculative.prompt_lookup_min=1"]
    assert run_generate(build_config(str(model_dir), overrides=base + spec), REPEATING) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if "speculative decoding" in ln]
    assert len(lines) == 1 and "tokens/s]" in err
    assert re.fullmatch(r"\[speculative decoding \(ngram, K=3\): acceptance rate [\d.]+% "
                        r"\(\d+ of [1-9]\d* draft tokens\), mean acceptance length [\d.]+ "
                        r"tokens per verify step\]", lines[0]), lines[0]
    assert "speculative" not in out  # stdout holds the completion only

    assert run_generate(build_config(str(model_dir), overrides=base), REPEATING) == 0
    assert "speculative" not in capsys.readouterr().err


def test_reply_meter_and_spec_line_arithmetic():
    meter = ReplyMeter()
    assert meter.lines() == ["no replies yet"]
    meter.record(10, 20, 2.0)
    meter.record(30, 10, 0.5)
    speed, tokens = meter.lines()
    assert "last reply 20.0 tok/s (10 tokens in 0.50 s)" in speed
    assert "overall 12.0 tok/s over 2 replies" in speed
    assert tokens.startswith("tokens: 40 in") and tokens.endswith("30 out")
    spec = SimpleNamespace(name="ngram", target=None, num_speculative_tokens=4)
    counts = SpecDecodeStats(10, 40, 30).since(SpecDecodeStats(2, 8, 6))
    assert (counts.acceptance_rate, counts.mean_acceptance_length) == (0.75, 4.0)
    assert "acceptance rate 75.0% (24 of 32 draft tokens), mean acceptance length 4.00" \
        in spec_decode_line(counts, spec)
    assert "no draft tokens proposed yet" in spec_decode_line(SpecDecodeStats(), spec)
