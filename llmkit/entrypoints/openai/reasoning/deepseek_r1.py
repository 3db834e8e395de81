"""DeepSeek-R1's ``<think>…</think>``: its chat template opens the thinking block in the
prompt, so the output's text before ``</think>`` is thinking whether or not the output
repeats ``<think>`` (vLLM's ``deepseek_r1``); an output cut off before ``</think>`` is all
thinking."""
from __future__ import annotations

from llmkit.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True
