"""What an engine refuses at start-up for a model with several KV-cache groups (sliding
windows beside full attention, recurrent states; ``llmkit.kv_cache.groups``): the features
that move or key one block table's KV, which would not carry every group. Each refusal is a
``ConfigError`` naming the key."""
from __future__ import annotations

from typing import Sequence

from llmkit.attention.kv_spec import MLASpec, RecurrentStateSpec
from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.kv_cache.groups import KVCacheGroup, describe_groups, is_single_group

__all__ = ["check_kv_cache_groups"]


def check_kv_cache_groups(config: EngineConfig, groups: Sequence[KVCacheGroup]) -> None:
    """Refuse the settings that cannot serve ``groups`` (nothing for one group of full
    attention or MLA, which keeps the one-table path)."""
    if len(groups) == 1 and isinstance(groups[0].spec, MLASpec):
        _refuse_kv_movers_for_mla(config)
    if not groups or is_single_group(groups):
        return
    what = f"this model's KV-cache groups ({describe_groups(groups)})"
    kt, ko = config.kv_transfer, config.kv_offload
    if kt.target is not None or kt.name != "none":
        raise ConfigError("kv_transfer", kt.target or kt.name, "none", message=(
            f"a KV connector moves one block table's KV; {what} have several. Use "
            "kv_transfer=none"))
    if ko.enabled:
        raise ConfigError("kv_offload.host_gib" if ko.host_gib else "kv_offload.disk_path",
                          ko.host_gib or ko.disk_path, "", message=(
                              f"the offload tiers keep one block table's KV; {what} have "
                              "several. Turn kv_offload off"))
    spec = config.speculative
    if spec.enabled and any(isinstance(g.spec, RecurrentStateSpec) for g in groups):
        raise ConfigError("speculative.name", spec.target or spec.name, "none", message=(
            f"speculative decoding with {what}: a recurrent state cannot take back rejected "
            "draft tokens. Use speculative.name=none"))
    if spec.runs_a_model:
        # its layers keep full-attention KV in the target's first block table, whose blocks
        # another group's rules (a window) may give back
        raise ConfigError("speculative.name", spec.target or spec.name, "none or ngram",
                          message=f"a draft model or EAGLE head keeps its KV in one block "
                          f"table; {what} have several. Use speculative.name=ngram (or "
                          "none)")
    pp = config.parallel.pipeline_parallel_size
    if pp > 1:
        raise ConfigError("parallel.pipeline_parallel_size", pp, "1", message=(
            f"pipeline stages with {what}: each stage's layers would need their own groups; "
            "use parallel.pipeline_parallel_size=1"))
    kv = config.kv_cache
    if kv.target is not None or kv.name != "paged":
        raise ConfigError("kv_cache", kv.target or kv.name, "paged", message=(
            f"{what} need the hybrid manager, which the built-in paged manager switches "
            "to; use kv_cache=paged"))
    if kv.pinned_prefixes:
        raise ConfigError("kv_cache.pinned_prefixes", f"{len(kv.pinned_prefixes)} prefixes",
                          "[]", message=f"pinned prefixes are kept in one group; {what} have "
                          "several. Leave kv_cache.pinned_prefixes empty")


def _refuse_kv_movers_for_mla(config: EngineConfig) -> None:
    """The KV connectors and offload tiers copy K/V layers laid out ``(2, blocks, ...)``; an MLA
    model's latent cache (``[blocks, block_size, latent_dim]``) is not handed to them."""
    kt, ko = config.kv_transfer, config.kv_offload
    what = "an MLA model's latent KV cache (DeepSeek)"
    if kt.target is not None or kt.name != "none":
        raise ConfigError("kv_transfer", kt.target or kt.name, "none", message=(
            f"a KV connector moves K/V layers, not {what} yet. Use kv_transfer=none"))
    if ko.enabled:
        raise ConfigError("kv_offload.host_gib" if ko.host_gib else "kv_offload.disk_path",
                          ko.host_gib or ko.disk_path, "", message=(
                              f"the offload tiers keep K/V layers, not {what} yet. Turn "
                              "kv_offload off"))
