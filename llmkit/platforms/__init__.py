"""Platforms, picked by ``platform=auto|cpu|cuda`` or added by the ``llmkit.platform_plugins``
entry point group."""
from __future__ import annotations

from llmkit.config.schema import PlatformConfig
from llmkit.platforms.base import Platform
from llmkit.platforms.cpu import CpuPlatform
from llmkit.platforms.cuda import CudaPlatform
from llmkit.registry import Registry

PLATFORMS: Registry[Platform] = Registry("platform", entry_point_group="llmkit.platform_plugins")
PLATFORMS.register("cpu")(CpuPlatform)
PLATFORMS.register("cuda")(CudaPlatform)
# "auto" is resolved by resolve_platform; registered so that config validation accepts it.
PLATFORMS.register("auto")(Platform)


def resolve_platform(config: PlatformConfig) -> Platform:
    if config.name == "auto" and not config.target:
        cls = CudaPlatform if CudaPlatform.is_available() else CpuPlatform
    else:
        cls = PLATFORMS.resolve(config.name, config.target)
    if not cls.is_available():
        raise RuntimeError(f"platform: {config.name!r} is not available on this machine")
    return cls(config)


__all__ = ["PLATFORMS", "Platform", "CpuPlatform", "CudaPlatform", "resolve_platform"]
