"""KV-cache groups: the layers that keep the same state, managed as one (vLLM's hybrid
allocator).

A model declares one :class:`~llmkit.attention.kv_spec.KVCacheSpec` per layer. Layers with
equal specs keep the same state per token (or per request), so they can share one block table:
a group. Every group draws block ids from one pool, and one block id's memory serves whichever
group holds it. For that, every group has the same number of layers ``k``: the layers of each
spec are split into chunks of ``k`` (the smallest spec's layer count, vLLM's rule for the n:1
interleaves models use; a spec's last chunk may be shorter), and the runner allocates ``k``
tensors of ``num_blocks`` pages, layer ``j`` of every group viewing tensor ``j``. A block
held by group g then costs ``k`` pages, wherever it is. Several groups may have equal specs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from llmkit.attention.kv_spec import (FullAttentionSpec, KVCacheSpec, MLASpec,
                                      RecurrentStateSpec, SlidingWindowSpec, layer_ranges)

__all__ = ["KVCacheGroup", "blocks_per_request", "describe_groups", "group_kv_cache_specs",
           "is_single_group", "spec_label"]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers (indices into the model's layer list) keeping ``spec``'s state; one block
    table per request."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]

    @property
    def label(self) -> str:
        return spec_label(self.spec)


def spec_label(spec: KVCacheSpec) -> str:
    """A short name for logs and metrics: ``full``, ``sliding_window(1024)``, ``mla``,
    ``recurrent``."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window({spec.sliding_window})"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    if isinstance(spec, MLASpec):
        return "mla"
    if isinstance(spec, RecurrentStateSpec):
        return "recurrent"
    return type(spec).__name__


def group_kv_cache_specs(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """The KV-cache groups of a model whose layer ``i`` keeps ``specs[i]``.

    One spec: one group of every layer. Several: each spec's layers (in layer order) are cut
    into chunks of ``k`` = the fewest layers any spec has, so that every group has at most
    ``k`` layers and the pool's ``k`` tensors serve them all (Gemma 3's 5:1 interleave of
    sliding and full layers: groups of the full layers' count)."""
    if not specs:
        raise ValueError("a model with no layers has no KV cache")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, s in enumerate(specs):
        by_spec.setdefault(s, []).append(i)
    if len(by_spec) == 1:
        (spec, layers), = by_spec.items()
        return [KVCacheGroup(spec, tuple(layers))]
    k = min(len(layers) for layers in by_spec.values())
    groups = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), k):
            groups.append(KVCacheGroup(spec, tuple(layers[start:start + k])))
    return groups


def is_single_group(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether the plain one-table manager (``KVCacheManager``) serves these groups: one group
    whose blocks are held for the whole request (full attention or MLA)."""
    return len(groups) == 1 and type(groups[0].spec) in (FullAttentionSpec, MLASpec)


def blocks_per_request(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int) -> int:
    """The most blocks one request of ``num_tokens`` tokens holds over every group (a window
    holds its window's blocks plus the one being filled; a recurrent state one block)."""
    full = -(-num_tokens // block_size)
    total = 0
    for g in groups:
        s = g.spec
        if isinstance(s, RecurrentStateSpec):
            total += 1
        elif isinstance(s, SlidingWindowSpec):
            total += min(full, -(-(s.sliding_window - 1) // block_size) + 1)
        else:
            total += full
    return total


def describe_groups(groups: Sequence[KVCacheGroup]) -> str:
    """``5 x sliding_window(1024) [layers 0-4, 6-10, ...], 1 x full [layers 5, 11]``: the
    groups by spec, in the order first seen."""
    by_label: dict[str, list[KVCacheGroup]] = {}
    for g in groups:
        by_label.setdefault(g.label, []).append(g)
    parts = []
    for label, gs in by_label.items():
        layers = sorted(i for g in gs for i in g.layer_ids)
        parts.append(f"{len(gs)} x {label} [layers {layer_ranges(layers)}]")
    return ", ".join(parts)
