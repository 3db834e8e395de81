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
    from llmkit.spec_decode import PROPOSERS
    from llmkit.structured_output import STRUCTURED_OUTPUT_BACKENDS

    return {
        "scheduler": SCHEDULERS,
        "kv_cache": KV_CACHE_MANAGERS,
        "attention": ATTENTION_BACKENDS,
        "sampler": SAMPLERS,
        "structured_output": STRUCTURED_OUTPUT_BACKENDS,
        "executor": EXECUTORS,
        "platform": PLATFORMS,
        "speculative": PROPOSERS,
    }


# Names a section accepts that are no registered implementation.
_NOT_REGISTERED = {"attention": "auto", "speculative": "none"}


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
        elif comp.name not in registry and comp.name != _NOT_REGISTERED.get(section):
            allowed = registry.names() + ([_NOT_REGISTERED[section]]
                                          if section in _NOT_REGISTERED else [])
            raise ConfigError(f"{section}.name", comp.name, ", ".join(sorted(allowed)))
    _check_attention_available(config)
    _check_linear_method(config)
    _check_speculative(config)


def _check_speculative(config: EngineConfig) -> None:
    """Speculation needs a scheduler that schedules draft tokens (a ``_target_`` scheduler
    that keeps ``Scheduler.update_draft_token_ids`` would refuse the first drafts mid-run)."""
    from llmkit.scheduler import SCHEDULERS
    from llmkit.scheduler.base import Scheduler

    spec = config.speculative
    if not spec.enabled:
        return
    sched = config.scheduler
    cls = SCHEDULERS.resolve(sched.name, sched.target)
    if getattr(cls, "update_draft_token_ids", None) is Scheduler.update_draft_token_ids:
        key = "speculative._target_" if spec.target else "speculative.name"
        raise ConfigError(key, spec.target or spec.name, "", message=(
            f"speculative decoding needs a scheduler that schedules draft tokens; "
            f"scheduler {sched.target or sched.name!r} ({cls.__name__}) does not: use "
            f"scheduler=token_budget or speculative=none"))


def _check_linear_method(config: EngineConfig) -> None:
    from llmkit.linear import LINEAR_METHODS

    choice = config.model.linear_method
    if choice == "auto":
        return
    try:
        if "." in choice:
            LINEAR_METHODS.resolve(None, choice)
        elif choice not in LINEAR_METHODS:
            raise ImportError
    except ImportError as e:
        allowed = ", ".join(["auto", *LINEAR_METHODS.names()])
        raise ConfigError("model.linear_method", choice,
                          f"{allowed} or an importable class path ({e})" if "." in choice
                          else allowed) from None


def _check_attention_available(config: EngineConfig) -> None:
    """Ask the attention backend whether it runs on the configured platform (e.g. ``triton``
    needs a CUDA GPU, or ``TRITON_INTERPRET=1`` on a CPU)."""
    from llmkit.attention import attention_backend_class
    from llmkit.platforms import resolve_platform

    try:
        platform = resolve_platform(config.platform)
    except Exception:  # an unavailable platform fails with its own error when the engine starts
        return
    attn = config.attention
    backend = attention_backend_class(attn, platform)
    check = getattr(backend, "check_available", None)
    why = check(platform) if check is not None else None
    if why:
        key = "attention._target_" if attn.target else "attention.name"
        value = attn.target or backend.name
        raise ConfigError(key, value, "", message=(
            f"{value!r} cannot run on platform {platform.name!r}: {why}; "
            f"use attention=torch there"))
