"""Typed engine configuration: pydantic models per component, Hydra composition of ``conf/``
(``compose_config`` for overrides, ``build_config`` for the Python API; ``*_tool_config`` for
the tools' configs, which hold an engine config beside their own sections) and ``ConfigError``.

The composition functions load Hydra on first use, so importing the schema stays cheap."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmkit.config.errors import ConfigError
from llmkit.config.schema import (
    AttentionConfig,
    EngineConfig,
    ExecutorConfig,
    KVCacheConfig,
    ModelConfig,
    PlatformConfig,
    SamplerConfig,
    SamplingDefaults,
    SchedulerConfig,
    ServerConfig,
)
from llmkit.config.tool_schema import BenchToolConfig, EvalToolConfig, SimToolConfig, ToolConfig

if TYPE_CHECKING:
    from llmkit.config.compose import (build_config, build_tool_config, compose_config,
                                       compose_tool_config, config_to_yaml)

__all__ = [
    "AttentionConfig",
    "BenchToolConfig",
    "ConfigError",
    "EngineConfig",
    "EvalToolConfig",
    "ExecutorConfig",
    "KVCacheConfig",
    "ModelConfig",
    "PlatformConfig",
    "SamplerConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "ServerConfig",
    "SimToolConfig",
    "ToolConfig",
    "build_config",
    "build_tool_config",
    "compose_config",
    "compose_tool_config",
    "config_to_yaml",
]

_LAZY = {"build_config", "build_tool_config", "compose_config", "compose_tool_config",
         "config_to_yaml"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from llmkit.config import compose
        return getattr(compose, name)
    raise AttributeError(f"module 'llmkit.config' has no attribute {name!r}")
