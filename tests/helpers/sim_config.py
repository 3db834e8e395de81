"""The sim tool's config for tests: a Llama-2-7B shape, no progress bar, plus overrides."""
from __future__ import annotations

from llmkit.tools.compose import compose_tool_config
from llmkit.tools.schema import SimToolConfig


def cfg_of(*overrides: str) -> SimToolConfig:
    return compose_tool_config(SimToolConfig,
                               ["sim.model=llama-2-7b", "bench.progress=false", *overrides])
