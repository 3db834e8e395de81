"""The `llmkit` command end to end on a tiny model (subprocesses, as a user runs it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmkit import LLM, SamplingParams

PROMPT = "Hello, \"world\" = it's a test, isn't it?"


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "llmkit.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_generate_prints_the_completion(model_dir):
    proc = run_cli("generate", str(model_dir), "--prompt", PROMPT, "model.dtype=float32",
                   "sampling.max_tokens=12", "sampling.temperature=0")
    assert proc.returncode == 0, proc.stderr
    expected = LLM(str(model_dir), dtype="float32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == expected + "\n"
    assert "tokens/s" in proc.stderr and "speculative" not in proc.stderr


def test_generate_without_prompt_is_a_one_line_error(model_dir):
    proc = run_cli("generate", str(model_dir))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_chat_streams_answers_and_keeps_history(model_dir):
    proc = run_cli("chat", str(model_dir), "model.dtype=float32", "chat.max_tokens=8",
                   stdin="hi there\n\n/help\nand again\n/stats\n/quit\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    # two turns, an empty line (ignored), /help, /stats, then /quit ends the chat
    assert proc.stdout.count(">>> ") == 6
    assert "/exit, Ctrl-D" in proc.stderr and "[speed: last reply" in proc.stderr


def test_chat_says_when_a_reply_is_cut_history_is_dropped_or_reset(model_dir):
    """A reply that hit chat.max_tokens is marked; /reset confirms; a conversation that
    outgrows model.max_model_len loses its oldest turns, and the chat says so."""
    long = "The quick brown fox jumps over the lazy dog near the river bank today"
    stdin = "\n".join(["hi there", "/reset", long, long, long, long * 6, "", ""])
    proc = run_cli("chat", str(model_dir), "model.dtype=float32", "chat.max_tokens=6",
                   "model.max_model_len=96", "sampling.temperature=0", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "replies up to chat.max_tokens=6 tokens" in err
    assert "[reply cut at chat.max_tokens=6 tokens; raise chat.max_tokens" in err
    assert err.count("[conversation forgotten") == 1
    assert "[the conversation outgrew model.max_model_len=96: dropped the oldest" in err
    assert "[this message alone is too long for model.max_model_len=96" in err
    assert "Traceback" not in err
