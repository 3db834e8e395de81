"""Typed engine configuration: pydantic models per component, Hydra composition of ``conf/``
(``compose_config`` for overrides, ``build_config`` for the Python API) and ``ConfigError``.
The tools' configs (an engine config beside their own sections) and their root are
``llmkit.tools.schema`` / ``llmkit.tools.compose``.

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

if TYPE_CHECKING:
    from llmkit.config.compose import build_config, compose_config, config_to_yaml

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "EngineConfig",
    "ExecutorConfig",
    "KVCacheConfig",
    "ModelConfig",
    "PlatformConfig",
    "SamplerConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "ServerConfig",
    "build_config",
    "compose_config",
    "config_to_yaml",
]

_LAZY = {"build_config", "compose_config", "config_to_yaml"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from llmkit.config import compose
        return getattr(compose, name)
    raise AttributeError(f"module 'llmkit.config' has no attribute {name!r}")
