"""The KV cache's memory for a model whose layers keep other state than full attention (its
``kv_cache_specs()``): sliding windows, MLA latents, recurrent states, or a mix.

Every KV-cache group (``llmkit.kv_cache.groups``) has at most ``k`` layers; the pool is ``k``
raw tensors of ``num_blocks`` pages, and layer ``j`` of every group views raw tensor ``j``, so
one block id's memory serves whichever group holds it. A block's bytes must then be the same
bytes in every view of a tensor:

- full-attention and sliding-window layers view it as the backend's cache,
  ``(2, num_blocks, block_size, heads, head_dim)``: block ``b`` is K rows at ``b * P/2`` and
  V rows at ``(num_blocks + b) * P/2`` (``P`` = a page's bytes). Their pages must be equal.
- recurrent layers' state tensors are ``[num_blocks, *shape]`` views (strided along
  ``num_blocks``, contiguous inside a block). Beside attention layers each state tensor sits
  inside the K half or the V half of its block's page (packed, largest first), so it lies in
  block ``b``'s bytes in the attention layers' view too; the attention block size is raised
  (to a multiple of ``kv_cache.block_size``) until the halves hold the state. Alone, a state
  page is one block-major page.
- MLA layers ``[num_blocks, block_size, latent_dim]`` (block-major): all of a model's layers
  are MLA, never beside another kind here.

One group of full attention never comes here: the runner keeps its own path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch

from llmkit.attention.base import AttentionBackend
from llmkit.attention.kv_spec import (FullAttentionSpec, KVCacheSpec, MLASpec,
                                      RecurrentStateSpec)
from llmkit.config.errors import ConfigError
from llmkit.kernels.kv_quant import cache_row_width
from llmkit.kernels.kv_quant import format_of as kv_quant_format_of
from llmkit.kv_cache.groups import (KVCacheGroup, describe_groups, group_kv_cache_specs,
                                    is_single_group)
from llmkit.worker import kv_cache_pool

logger = logging.getLogger(__name__)

__all__ = ["KVCachePlan", "allocate_kv_caches", "first_attention_cache", "plan_kv_cache"]


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class StateSlot:
    """Where one recurrent state tensor lies in a page: the K (0) or V (1) half of an
    attention page (``half=None``: a block-major page) and its byte offset there."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    half: int | None
    offset: int


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How the pool's memory is laid out for ``groups``: ``num_tensors`` raw tensors of
    ``page_bytes`` per block; layer ``i`` belongs to group ``layer_to_group[i]`` and views
    raw tensor ``layer_to_tensor[i]``."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    page_bytes: int
    num_tensors: int
    layer_to_group: tuple[int, ...]
    layer_to_tensor: tuple[int, ...]
    kv_cache_dtype: torch.dtype
    state_dtype: torch.dtype
    # per recurrent spec, where its tensors lie in a page
    state_slots: dict[RecurrentStateSpec, tuple[StateSlot, ...]]

    @property
    def bytes_per_block(self) -> int:
        """One block id's memory over every raw tensor (what the pool is sized by)."""
        return self.page_bytes * self.num_tensors

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def single_table(self) -> bool:
        """Whether the plain one-table manager serves it (one group of MLA): block ids then
        travel as one list, not one per group."""
        return is_single_group(self.groups)

    def is_recurrent(self, group: int) -> bool:
        return isinstance(self.groups[group].spec, RecurrentStateSpec)

    def describe(self, num_blocks: int | None = None) -> str:
        blocks = "" if num_blocks is None else f"; {num_blocks} blocks of {self.block_size} " \
            f"tokens, {self.num_tensors} tensors of {self.page_bytes} bytes a block"
        return describe_groups(self.groups) + blocks


def plan_kv_cache(specs: Sequence[KVCacheSpec], block_size: int, kv_cache_dtype: torch.dtype,
                  state_dtype: torch.dtype, backend: AttentionBackend) -> KVCachePlan | None:
    """The pool's layout for a model whose layer ``i`` keeps ``specs[i]``; None for one group
    of full attention (the runner's own path). ``state_dtype``: recurrent states' dtype where
    their spec names none (the model's). Raises ``ConfigError`` for what cannot share a pool
    (naming the setting) and ``ValueError`` for a mix of specs no layout here serves."""
    groups = group_kv_cache_specs(specs)
    if len(groups) == 1 and type(groups[0].spec) is FullAttentionSpec:
        return None
    kinds = {type(g.spec) for g in groups}
    attn = [g.spec for g in groups if isinstance(g.spec, FullAttentionSpec)]
    states = [g.spec for g in groups if isinstance(g.spec, RecurrentStateSpec)]
    quant = kv_quant_format_of(kv_cache_dtype)
    if MLASpec in kinds:
        if len(kinds) > 1:
            raise ValueError("a model mixing MLA layers with other KV-cache specs ("
                             f"{describe_groups(groups)}) has no pool layout here")
        if quant is not None:
            raise ConfigError("kv_cache.cache_dtype", quant.name,
                              "auto, bfloat16 or float16 for an MLA model (its latent cache "
                              "has no quantized readers)")
        spec = groups[0].spec
        page = block_size * spec.latent_dim * _elt(kv_cache_dtype)
        return _plan(groups, block_size, page, kv_cache_dtype, state_dtype, {})

    def attn_page(spec: FullAttentionSpec, bs: int) -> int:
        shape = backend.kv_cache_shape(1, bs, spec.num_kv_heads,
                                       cache_row_width(spec.head_dim, kv_cache_dtype))
        return prod(shape) * _elt(kv_cache_dtype)

    if not attn:  # recurrent states only: block-major pages
        slots, page = {}, 0
        for s in dict.fromkeys(states):
            slots[s], used = _pack(s, state_dtype, None)
            page = max(page, used)
        return _plan(groups, block_size, page, kv_cache_dtype, state_dtype, slots)

    pages = {s: attn_page(s, block_size) for s in attn}
    if len(set(pages.values())) > 1:
        raise ValueError("attention layers with different bytes per token (" + ", ".join(
            f"{s}: {p} bytes a block" for s, p in pages.items()) + ") cannot share one pool")
    if states and quant is not None:
        raise ConfigError("kv_cache.cache_dtype", quant.name,
                          "auto, bfloat16 or float16 for a model with recurrent layers")
    bs = block_size
    slots = {}
    if states:
        half_needed = 0
        for s in dict.fromkeys(states):
            slots[s], used = _pack(s, state_dtype, 2)
            half_needed = max(half_needed, used)
        half_per_token = attn_page(attn[0], 1) // 2
        while half_per_token * bs < half_needed:
            bs += block_size
        if bs != block_size:
            logger.info("kv_cache.block_size: %d tokens a block for this model's attention "
                        "layers, not %d, so that a block's page (%d bytes a layer) holds a "
                        "recurrent state (%d bytes a layer)", bs, block_size,
                        2 * half_per_token * bs,
                        max(s.state_bytes(state_dtype) for s in states))
    return _plan(groups, bs, attn_page(attn[0], bs), kv_cache_dtype, state_dtype, slots)


def _pack(spec: RecurrentStateSpec, default_dtype: torch.dtype, halves: int | None
          ) -> tuple[tuple[StateSlot, ...], int]:
    """Place the spec's tensors in a page (``halves=2``: each wholly in one half, the fuller
    half as small as packing largest-first makes it); the slots and the bytes used (of the
    fuller half)."""
    dtype = spec.dtype or default_dtype
    elt = _elt(dtype)
    align = 64  # each tensor starts on a cache line
    order = sorted(range(len(spec.shapes)), key=lambda i: -prod(spec.shapes[i]))
    fill = [0] * (halves or 1)
    placed: dict[int, StateSlot] = {}
    for i in order:
        h = min(range(len(fill)), key=fill.__getitem__)
        placed[i] = StateSlot(tuple(spec.shapes[i]), dtype, h if halves else None, fill[h])
        fill[h] += -(-prod(spec.shapes[i]) * elt // align) * align
    return tuple(placed[i] for i in range(len(spec.shapes))), max(fill)


def _plan(groups: list[KVCacheGroup], block_size: int, page_bytes: int,
          kv_cache_dtype: torch.dtype, state_dtype: torch.dtype,
          slots: dict) -> KVCachePlan:
    num_layers = sum(len(g.layer_ids) for g in groups)
    to_group = [0] * num_layers
    to_tensor = [0] * num_layers
    for gi, g in enumerate(groups):
        for j, layer in enumerate(g.layer_ids):
            to_group[layer] = gi
            to_tensor[layer] = j
    return KVCachePlan(tuple(groups), block_size, page_bytes,
                       max(len(g.layer_ids) for g in groups), tuple(to_group),
                       tuple(to_tensor), kv_cache_dtype, state_dtype, slots)


def _zeros_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """Zeroed raw bytes (lazily on the CPU, in small pages: ``kv_cache_pool.zeros``). Zero,
    not empty: a window's null block is read (and masked) but never written."""
    return kv_cache_pool.zeros((nbytes,), torch.uint8, device)


def allocate_kv_caches(plan: KVCachePlan, num_blocks: int, backend: AttentionBackend,
                       device: torch.device) -> list:
    """Each layer's cache object (``kv_caches[i]``) over ``plan.num_tensors`` shared raw
    tensors: the backend's tensor for attention layers, ``[N, block_size, latent_dim]`` for
    MLA, a tuple of ``[N, *shape]`` state tensors for recurrent layers."""
    logger.info("KV cache groups: %s", plan.describe(num_blocks))
    raws = [_zeros_bytes(num_blocks * plan.page_bytes, device)
            for _ in range(plan.num_tensors)]
    caches: list = [None] * len(plan.layer_to_group)
    for layer, (g, j) in enumerate(zip(plan.layer_to_group, plan.layer_to_tensor)):
        caches[layer] = _view(plan, plan.groups[g].spec, raws[j], num_blocks, backend)
    return caches


def first_attention_cache(caches: list) -> torch.Tensor | None:
    """The first full or sliding attention layer's cache (what a backend warms up with)."""
    return next((c for c in caches if isinstance(c, torch.Tensor) and c.dim() == 5), None)


def _view(plan: KVCachePlan, spec: KVCacheSpec, raw: torch.Tensor, n: int,
          backend: AttentionBackend):
    bs, page = plan.block_size, plan.page_bytes
    if isinstance(spec, FullAttentionSpec):
        shape = backend.kv_cache_shape(n, bs, spec.num_kv_heads,
                                       cache_row_width(spec.head_dim, plan.kv_cache_dtype))
        return raw.view(plan.kv_cache_dtype).view(shape)
    if isinstance(spec, MLASpec):
        return raw.view(plan.kv_cache_dtype).view(n, bs, spec.latent_dim)
    states = []
    for slot in plan.state_slots[spec]:
        elt = _elt(slot.dtype)
        typed = raw.view(slot.dtype)
        if slot.half is None:  # block-major page
            block_stride, base = page, slot.offset
        else:  # inside the K or V half of an attention page
            block_stride, base = page // 2, slot.half * n * (page // 2) + slot.offset
        inner = torch.empty(slot.shape, device="meta").stride()
        states.append(typed.as_strided((n, *slot.shape), (block_stride // elt, *inner),
                                       base // elt))
    return tuple(states)
