"""Reasoning parsers by name (``server.reasoning_parser``; ``none``, the default, keeps the
thinking in ``content``). One parser a file; ``base.py`` has the text state machine."""
from __future__ import annotations

from llmkit.entrypoints.openai.reasoning.base import (ReasoningParser, ReasoningSplit,
                                                      ReasoningStreamer)
from llmkit.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from llmkit.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser
from llmkit.registry import Registry

REASONING_PARSERS: Registry = Registry("reasoning_parser")
REASONING_PARSERS.register("deepseek_r1")(DeepSeekR1ReasoningParser)
REASONING_PARSERS.register("qwen3")(Qwen3ReasoningParser)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStreamer",
           "check_reasoning_parser"]


def check_reasoning_parser(name: str) -> None:
    """A ``ConfigError`` naming ``server.reasoning_parser`` for an unknown parser."""
    from llmkit.config.errors import ConfigError

    if name != "none" and name not in REASONING_PARSERS:
        raise ConfigError("server.reasoning_parser", name,
                          ", ".join(["none", *REASONING_PARSERS.names()]))
