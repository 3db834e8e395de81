"""What an :class:`~llmkit.engine.loop.core.EngineCore` runs on, built once from its config: the
platform, the executor (and with it the model), the KV pool's size, the KV connector, the KV
cache manager, the structured-output manager and the scheduler.

The order is the dependencies': the pool's size needs the executor's bytes per block; a KV
connector's worker side comes before the pool is allocated (it may own the pool's memory); the
scheduler needs the KV cache manager and the connector. ``kv_cache.block_size`` is read here
once and handed to what needs it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.engine.loop.components import validate_components
from llmkit.executor import Executor, executor_class
from llmkit.engine.loop.kv_groups_check import check_kv_cache_groups
from llmkit.kv_cache import KV_CACHE_MANAGERS, KVCacheManagerBase
from llmkit.kv_cache.groups import blocks_per_request, is_single_group
from llmkit.kv_cache.hybrid import HybridKVCacheManager
from llmkit.kv_cache.pinned_prefixes import pinned_prefix_ids
from llmkit.kv_transfer import KVConnectorBase, KVConnectorRole, KVLayout, kv_connector_class
from llmkit.kv_transfer.fingerprint import kv_fingerprint
from llmkit.models.pooling_config import resolve_pooling
from llmkit.platforms import resolve_platform
from llmkit.platforms.base import Platform
from llmkit.scheduler import SCHEDULERS, Scheduler
from llmkit.startup import startup_step
from llmkit.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreParts:
    """The subsystems one engine core drives."""

    platform: Platform
    executor: Executor
    num_blocks: int
    kv_connector: KVConnectorBase | None
    kv_cache_manager: KVCacheManagerBase
    structured_output_manager: StructuredOutputManager
    scheduler: Scheduler


def build_core_parts(config: EngineConfig, *, executor: Executor | None = None,
                     clock: Callable[[], float] = time.monotonic,
                     **executor_kwargs: Any) -> CoreParts:
    """Check ``config`` and build the subsystems (the executor only when none is given;
    ``executor_kwargs`` go to its constructor)."""
    validate_components(config)
    if config.parallel.data_parallel_size > 1:
        raise ConfigError("parallel.data_parallel_size", config.parallel.data_parallel_size,
                          "1 for one EngineCore (several engine cores run behind LLM, "
                          "AsyncLLM and llmkit serve: llmkit.engine.dp.client)")
    platform = resolve_platform(config.platform)
    platform.apply_runtime_settings()
    model_source = executor_kwargs.get("model_source")
    if executor is None:
        exec_cls = executor_class(config)
        with startup_step("loading the model"):
            executor = exec_cls(config, platform, **executor_kwargs)
    facts = executor.model_facts
    kv_cfg = config.kv_cache
    # A model with other KV-cache specs than full attention: its groups, and the block size
    # its pool's layout needs (the workers' plan).
    groups = facts.kv_cache_groups
    check_kv_cache_groups(config, groups)
    block_size = facts.kv_block_size or kv_cfg.block_size
    num_blocks = num_kv_blocks(config, executor, platform, facts.max_model_len, block_size,
                               groups)
    # The connector's worker side first, since it may own the pool's memory.
    connector: KVConnectorBase | None = None
    conn_cls = kv_connector_class(config)
    if conn_cls is not None:
        layout = kv_layout(config, executor, model_source)
        executor.init_kv_connector(conn_cls, layout)
        connector = conn_cls(config, KVConnectorRole.SCHEDULER, layout)
    with startup_step("allocating the KV cache"):
        executor.initialize_kv_cache(num_blocks)

    def load_tokenizer():
        source = model_source
        if source is None:
            from llmkit.models.loader import resolve_model_source
            source = resolve_model_source(config.model)
        return source.load_tokenizer()

    kv_cls = KV_CACHE_MANAGERS.resolve(kv_cfg.name, kv_cfg.target)
    # Pooling that needs every prompt token's hidden state (mean, CLS) cannot start behind a
    # prefix-cache hit, which skips computing them (llmkit/worker/pooling.py).
    # (The simulator computes nothing, and may stand for a model whose files are not here.)
    # (Only a pooling runner reads the model's files here: the core may not hold them yet.)
    pooling = None
    if config.executor.name != "sim" and config.model.runner != "generate":
        source = model_source
        if source is None:
            from llmkit.models.loader import resolve_model_source
            source = resolve_model_source(config.model)
        pooling = resolve_pooling(config.model, source)
    prefix_caching = kv_cfg.enable_prefix_caching and (pooling is None
                                                       or not pooling.needs_every_token)
    if groups and not is_single_group(groups):
        kv = HybridKVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                                  max_model_len=facts.max_model_len, groups=groups,
                                  eviction_policy=kv_cfg.eviction_policy)
    else:
        kv = kv_cls(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                    max_model_len=facts.max_model_len, eviction_policy=kv_cfg.eviction_policy,
                    pinned_prefixes=pinned_prefix_ids(kv_cfg.pinned_prefixes,
                                                      prefix_caching, load_tokenizer))
        if groups:
            kv.group_label = groups[0].label
    # Grammars compile in its thread pool; its tokenizer loads with the first grammar.
    structured = StructuredOutputManager(
        config.structured_output, vocab_size=facts.vocab_size, tokenizer_loader=load_tokenizer,
        # a step's bitmask walks a request's drafts through its matcher and takes them back
        max_rollback_tokens=config.speculative.num_speculative_tokens
        if config.speculative.enabled else 0)
    if connector is not None:
        connector.bind_block_hasher(kv.ensure_block_hashes)
        kv.set_eviction_listener(connector.on_blocks_evicted)
    if pooling is not None and pooling.bidirectional:  # an encoder's prompt is one step's
        config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
            update={"enable_chunked_prefill": False})})
    scheduler = build_scheduler(config, executor, kv, structured, connector, clock,
                                model_source)
    return CoreParts(platform, executor, num_blocks, connector, kv, structured, scheduler)


def build_scheduler(config: EngineConfig, executor: Executor, kv: KVCacheManagerBase,
                    structured: StructuredOutputManager, connector: KVConnectorBase | None,
                    clock: Callable[[], float], model_source: Any = None) -> Scheduler:
    """The configured scheduler, with the keyword arguments its features need."""
    sched_cls = SCHEDULERS.resolve(config.scheduler.name, config.scheduler.target)
    kwargs: dict[str, Any] = {}
    if sched_cls.serves_slo:
        kwargs.update(slo=config.slo, step_time=slo_step_time(config, executor, model_source))
    if config.speculative.name == "eagle":
        kwargs["drop_last_cached_block"] = True
    if config.lora.enabled:
        check_lora_support(executor, sched_cls)
        kwargs.update(max_loras=config.lora.max_loras,
                      max_lora_skips=config.lora.max_skipped_steps)
    pp = config.parallel.pipeline_parallel_size
    if pp > 1:
        kwargs["pipeline_parallel_size"] = pp
    if connector is not None:
        kwargs["kv_connector"] = connector
    facts = executor.model_facts
    return sched_cls(config.scheduler, kv, max_model_len=facts.max_model_len,
                     eos_token_id=facts.eos_token_id, clock=clock,
                     structured_output_manager=structured, **kwargs)


def slo_step_time(config: EngineConfig, executor: Executor,
                  model_source: Any = None) -> Callable[[Any, float], float]:
    """Seconds one step of given work takes, for ``scheduler=slo``: the executor's own cost
    model (the simulator's; with ``scheduler.cost_profile`` set, its model on that profile
    instead, as a server predicting with a profile that is off), else one built for this model,
    dtype and ``scheduler.cost_profile`` (start-up says which profile, and warns when it was not
    measured on this machine)."""
    cost = executor.step_cost_model()
    spec = config.scheduler.cost_profile
    if cost is not None and spec is None:
        logger.info("scheduler=slo: predicting step times with the executor's cost model "
                    "(hardware profile %s)", cost.hw.name)
    elif cost is not None:
        from llmkit.cost_model.engine_profile import resolve_cost_profile
        from llmkit.cost_model.step_cost import CostModel

        profile, where, _ = resolve_cost_profile(spec)
        cost = CostModel(cost.shape, profile, cost.dtype, tensor_parallel_size=cost.tp,
                         kv_dtype=cost.kv_dtype, pipeline_parallel_size=cost.pp)
        logger.info("scheduler=slo: predicting the executor's steps with %s", where)
    else:
        from llmkit.cost_model.engine_profile import engine_cost_model, resolve_cost_profile

        profile, where, measured = resolve_cost_profile(spec)
        if model_source is None:
            from llmkit.models.loader import resolve_model_source
            model_source = resolve_model_source(config.model)
        par = config.parallel
        cost = engine_cost_model(model_source.hf_config, profile, executor.backend_info.dtype,
                                 name=config.model.name or "model",
                                 tensor_parallel_size=par.tensor_parallel_size,
                                 pipeline_parallel_size=par.pipeline_parallel_size)
        (logger.info if measured else logger.warning)(
            "scheduler=slo: predicting step times with %s (slo: ttft_ms=%s tpot_ms=%s "
            "e2el_ms=%s)", where, config.slo.ttft_ms, config.slo.tpot_ms, config.slo.e2el_ms)
    step = cost.step
    return lambda work, stream_rate=0.0: step(work, stream_rate).total_s


def check_lora_support(executor: Executor, sched_cls: type) -> None:
    """``lora.enabled`` needs an executor that loads adapters and a scheduler that keeps a
    step's adapters within the slots; a ``ConfigError`` naming the one that cannot."""
    # (classes named by _target_ need not derive from the ABCs that declare the flags)
    if not getattr(executor, "supports_lora", False):
        raise ConfigError("lora.enabled", True, "", message=(
            f"executor {type(executor).__name__} does not serve LoRA adapters; use "
            "executor=uniproc, executor=multiproc or lora.enabled=false"))
    if not getattr(sched_cls, "supports_lora", False):
        raise ConfigError("lora.enabled", True, "", message=(
            f"scheduler {sched_cls.__name__} cannot limit the adapters of a step (its "
            "constructor takes no max_loras); use scheduler=token_budget or "
            "lora.enabled=false"))


def kv_layout(config: EngineConfig, executor: Executor, model_source=None) -> KVLayout:
    """The pool's layout and the fingerprint of the KV this engine computes: its model's
    weights and config, dtype, block size and block shape."""
    if model_source is None:
        from llmkit.models.loader import resolve_model_source
        model_source = resolve_model_source(config.model)
    layout = executor.kv_layout("")
    fp = kv_fingerprint(model_source.path, dtype=layout.dtype, block_size=layout.block_size,
                        block_shape=layout.block_shape, block_dim=layout.block_dim,
                        num_layers=layout.num_layers, linear_method=config.model.linear_method)
    return KVLayout(layout.num_layers, layout.block_shape, layout.block_dim, layout.dtype,
                    layout.block_size, fp)


def num_kv_blocks(config: EngineConfig, executor: Executor, platform: Platform,
                  max_model_len: int, block_size: int, groups: Sequence = ()) -> int:
    """``kv_cache.num_blocks``, else as many blocks as ``kv_cache.memory_gib`` holds, never
    more than every sequence at full length needs (the rest would be idle memory; with
    several KV-cache groups, what one sequence holds over every group, plus the null
    block)."""
    kv_cfg = config.kv_cache
    if kv_cfg.num_blocks is not None:
        return kv_cfg.num_blocks
    per_block = executor.kv_cache_bytes_per_block()
    budget = platform.kv_cache_budget_bytes(kv_cfg.memory_gib)
    blocks_per_seq = -(-max_model_len // block_size)
    if groups and not is_single_group(groups):
        blocks_per_seq = blocks_per_request(groups, max_model_len, block_size) + 1
    cap = blocks_per_seq * config.scheduler.max_num_seqs
    num = min(budget // per_block, cap)
    if num < blocks_per_seq:
        logger.warning("kv_cache.memory_gib=%s holds %d blocks of %d tokens, fewer than one "
                       "sequence of max_model_len=%d needs", kv_cfg.memory_gib, num,
                       block_size, max_model_len)
    return max(int(num), 1)
