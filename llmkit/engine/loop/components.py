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
_NOT_REGISTERED = {"attention": "auto", "speculative": "none", "executor": "auto"}


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
    _check_cpu_dispatch(config)
    from llmkit.kv_transfer import kv_connector_class

    kv_connector_class(config)  # a connector that cannot work fails here, naming the key
    _check_speculative(config)
    _check_kv_connector_combinations(config)
    _check_kv_cache_dtype(config)


def _check_cpu_dispatch(config: EngineConfig) -> None:
    """The CPU dispatch table resolves (``platform.dispatch`` over the tier's defaults): a
    value out of range for the resolved table (step graphs beyond the C++ linear's rows) fails
    here, naming its key, not when the platform is built."""
    from llmkit.config.cpu_dispatch import resolve_dispatch
    from llmkit.config.cpu_isa import resolve_tier

    resolve_dispatch(resolve_tier(config.platform.isa), config.platform.dispatch)


def _check_kv_cache_dtype(config: EngineConfig) -> None:
    """A cache dtype other than the model's needs an attention backend whose readers convert or
    dequantize it (``AttentionBackend.kv_cache_dtypes``); the simulator models KV at the
    model's dtype only."""
    value = config.kv_cache.cache_dtype
    if value == "auto":
        return
    if config.executor.name == "sim":
        raise ConfigError("kv_cache.cache_dtype", value, "auto (executor=sim models the KV "
                          "cache at the model's dtype)")
    from llmkit.attention import attention_backend_class
    from llmkit.platforms import resolve_platform

    try:
        platform = resolve_platform(config.platform)
    except Exception:  # an unavailable platform fails with its own error when the engine starts
        return
    backend = attention_backend_class(config.attention, platform)
    allowed = backend.kv_cache_dtypes
    if value not in allowed:
        raise ConfigError("kv_cache.cache_dtype", value, "", message=(
            f"got {value!r}, but attention backend {backend.name!r} reads "
            f"{', '.join(allowed)} only; use kv_cache.cache_dtype=auto or attention=cpu|torch|"
            "triton"))


def _check_kv_connector_combinations(config: EngineConfig) -> None:
    """Combinations whose KV a connector would get wrong are refused, not served."""
    kt, ko = config.kv_transfer, config.kv_offload
    connector = kt.target is not None or kt.name != "none" or ko.enabled
    if not connector:
        return
    key = "kv_offload.host_gib" if ko.enabled and ko.host_gib else (
        "kv_offload.disk_path" if ko.enabled else "kv_transfer.name")
    value = ko.host_gib if key == "kv_offload.host_gib" else (
        ko.disk_path if key == "kv_offload.disk_path" else kt.target or kt.name)
    if config.speculative.enabled and config.speculative.name == "eagle":
        # EAGLE recomputes the last cached block (its hidden states are not in the KV); the
        # blocks a connector loads would need the same rule, which it does not apply.
        raise ConfigError(key, value, "", message=(
            "KV connectors do not work with speculative=eagle yet; use speculative=ngram, "
            "speculative=draft_model or speculative=none"))
    if config.lora.enabled and ko.enabled and ko.disk_path:
        # Block hashes carry the adapter's lora_int_id, which names another adapter after a
        # restart: a disk tier would serve one adapter's KV to another.
        raise ConfigError("kv_offload.disk_path", ko.disk_path, "", message=(
            "the disk tier outlives the engine but adapter ids do not; with lora.enabled=true "
            "use the host tier only (kv_offload.disk_path=null)"))


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
    why = backend.check_available(platform)
    if why:
        key = "attention._target_" if attn.target else "attention.name"
        value = attn.target or backend.name
        raise ConfigError(key, value, "", message=(
            f"{value!r} cannot run on platform {platform.name!r}: {why}; "
            f"use attention=torch there"))
