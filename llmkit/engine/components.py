"""Which registry serves which config section, and the check that every named implementation
exists — made when an engine is assembled (and by `llmkit config`), never deep inside a step."""
from __future__ import annotations

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.registry import Registry


def component_registries() -> dict[str, Registry]:
    from llmkit.attention import ATTENTION_BACKENDS
    from llmkit.executor import EXECUTORS
    from llmkit.kv_cache import KV_CACHE_MANAGERS
    from llmkit.platforms import PLATFORMS
    from llmkit.sampling import SAMPLERS
    from llmkit.scheduler import SCHEDULERS

    return {
        "scheduler": SCHEDULERS,
        "kv_cache": KV_CACHE_MANAGERS,
        "attention": ATTENTION_BACKENDS,
        "sampler": SAMPLERS,
        "executor": EXECUTORS,
        "platform": PLATFORMS,
    }


def validate_components(config: EngineConfig) -> None:
    """Raise ConfigError naming ``<section>.name`` (or ``._target_``) if it cannot be built."""
    for section, registry in component_registries().items():
        comp = getattr(config, section)
        if comp.target:
            try:
                registry.resolve(None, comp.target)
            except ImportError as e:
                raise ConfigError(f"{section}._target_", comp.target,
                                  f"an importable class path ({e})") from None
        elif comp.name not in registry:
            raise ConfigError(f"{section}.name", comp.name, ", ".join(registry.names()))
