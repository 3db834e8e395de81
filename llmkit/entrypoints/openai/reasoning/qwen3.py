"""Qwen3's ``<think>…</think>``: thinking needs its start marker — written by the model at the
start of its output, or left open at the end of the prompt by the template; an output that
starts any other way is all answer (vLLM's ``qwen3``). ``enable_thinking=false``
(``chat_template_kwargs``) makes Qwen3's template close an empty block in the prompt: the
output is then all answer. An output cut off inside the block is all thinking (what was
streamed as thinking stays thinking)."""
from __future__ import annotations

from llmkit.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_start = False
