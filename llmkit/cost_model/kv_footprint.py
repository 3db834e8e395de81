"""What a model's KV state costs, by KV-cache spec: bytes a request holds, bytes a step reads
and writes, attention FLOPs, and how many requests fit a pool.

The model's per-layer specs (``llmkit.models.kv_specs``, read from its config) fall into groups
of equal specs (as the engine's KV cache manager groups them). Per layer of a group, on one
tensor-parallel rank, with ``b`` the KV dtype's bytes, a request of context ``c`` holds:

- full attention (K and V, ``n_kv`` heads of ``d``): ``c · 2·n_kv·d·b`` bytes;
- a sliding window ``W``: ``min(c, W) · 2·n_kv·d·b`` — in blocks of ``B`` tokens, at most
  ``⌈(W − 1)/B⌉ + 1`` blocks (the blocks wholly before the window are freed as it slides);
- MLA: ``c · (kv_lora_rank + qk_rope_head_dim)·b`` — one latent row shared by every head, whole
  on every rank;
- a recurrent state: its fixed ``S`` bytes (one block per request), whatever ``c``.

A step that computes ``q`` new tokens of a request whose context is ``c`` after it reads the
keys its queries see and writes the new rows: ``c + q`` rows for full attention and MLA,
``min(c, q + W − 1) + q`` for a window (the union of the ``q`` queries' windows), and ``2·S``
bytes for a state (read, then written back). Query–key pairs: ``q(c − q) + q(q + 1)/2`` (causal),
for a window ``Σ_{j=c−q+1..c} min(j, W)``; a pair costs ``4·n_h·d`` FLOPs (QKᵀ and PV) in
attention, ``2·n_h·(2·r + rope)`` in MLA's absorbed form (QKᵀ over the latent and the rope
part, PV over the latent); a state layer's scan is left out (per token, small next to its
projections, which the parameter count prices).

With only full-attention layers everything reduces to the single ``κ = 2·L·n_kv·d·b`` bytes per
token the cost model always used.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from llmkit.attention.kv_spec import (FullAttentionSpec, KVCacheSpec, MLASpec,
                                      RecurrentStateSpec, SlidingWindowSpec)
from llmkit.models.kv_specs import kv_cache_groups, spec_label

__all__ = ["KVFootprint", "KVGroup", "TORCH_DTYPES", "rank_specs"]

# the simulator's dtype names -> the torch dtypes the specs price
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def rank_specs(specs: Sequence[KVCacheSpec], tp: int) -> list[KVCacheSpec]:
    """What one of ``tp`` tensor-parallel ranks keeps of each layer's spec (the model's
    ``kv_cache_specs()`` on that rank): KV heads split (replicated when fewer than the ranks),
    the MLA latent whole; a recurrent state as given (its split is the model's)."""
    if tp == 1:
        return list(specs)
    out: list[KVCacheSpec] = []
    for s in specs:
        if isinstance(s, FullAttentionSpec):
            s = replace(s, num_kv_heads=max(1, -(-s.num_kv_heads // tp)))
        out.append(s)
    return out


def _pairs(q: int, c: int, window: int | None) -> float:
    """Causal query–key pairs of ``q`` queries at positions ``c − q .. c − 1``, each seeing at
    most ``window`` keys."""
    if window is None or window >= c:
        return q * (c - q) + q * (q + 1) / 2.0
    a, b, w = c - q + 1, c, window  # each query j (1-based length) sees min(j, w) keys
    if a >= w:
        return float(w * q)
    return (a + w) * (w - a + 1) / 2.0 + (b - w) * w


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers with one spec, priced on one tensor-parallel rank."""

    spec: KVCacheSpec
    layers: tuple[int, ...]
    bytes_per_token: float  # one layer (0 for a state)
    state_bytes: float  # one layer, one request (recurrent state only)
    window: int | None
    flops_per_pair: float  # one layer, one query–key pair

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, RecurrentStateSpec)

    def tokens_held(self, context_len: int) -> int:
        if self.is_state:
            return 0
        return context_len if self.window is None else min(context_len, self.window)

    def blocks_held(self, context_len: int, block_size: int) -> int:
        """Blocks one request of ``context_len`` tokens holds in this group."""
        if self.is_state:
            return 1
        n = -(-context_len // block_size)
        if self.window is not None:
            n = min(n, -(-(self.window - 1) // block_size) + 1)
        return n

    def page_bytes(self, block_size: int) -> float:
        """One block of one layer."""
        return self.state_bytes if self.is_state else block_size * self.bytes_per_token

    def held_bytes(self, context_len: int, block_size: int | None = None) -> float:
        """One request, every layer of the group (whole blocks when ``block_size`` is
        given)."""
        n = len(self.layers)
        if block_size is not None:
            return n * self.blocks_held(context_len, block_size) * self.page_bytes(block_size)
        return n * (self.state_bytes + self.tokens_held(context_len) * self.bytes_per_token)

    def step_rows(self, q: int, c: int) -> int:
        """KV rows one layer reads and writes for ``q`` new tokens, context ``c`` after."""
        if self.window is None:
            return c + q
        return min(c, q + self.window - 1) + q

    def pairs(self, q: int, c: int) -> float:
        return 0.0 if self.is_state else _pairs(q, c, self.window)


def _group(spec: KVCacheSpec, layers: tuple[int, ...], dtype: torch.dtype, tp: int,
           num_heads: int) -> KVGroup:
    """``spec`` is the whole model's (``tp`` = 1); this rank's share is worked out here."""
    size = torch.empty((), dtype=dtype).element_size()
    heads = num_heads / tp  # query heads split over the ranks
    if isinstance(spec, RecurrentStateSpec):
        # Mamba-2 splits its heads and groups over the ranks
        return KVGroup(spec, layers, 0.0, spec.state_bytes(dtype) / tp, None, 0.0)
    if isinstance(spec, MLASpec):
        return KVGroup(spec, layers, float(spec.bytes_per_token(dtype)), 0.0, None,
                       2.0 * heads * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim))
    if isinstance(spec, FullAttentionSpec):
        kv_heads = max(1, -(-spec.num_kv_heads // tp))  # replicated when fewer than ranks
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        return KVGroup(spec, layers, float(2 * kv_heads * spec.head_dim * size), 0.0, window,
                       4.0 * heads * spec.head_dim)
    raise TypeError(f"the simulator cannot price KV-cache spec {spec!r}")


class KVFootprint:
    """A model's KV state by group, on one rank: ``specs`` one per layer (tp = 1),
    ``kv_dtype`` a simulator dtype name."""

    def __init__(self, specs: Sequence[KVCacheSpec], kv_dtype: str, num_heads: int,
                 tp: int = 1) -> None:
        try:
            dtype = TORCH_DTYPES[kv_dtype]
        except KeyError:
            raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: "
                             f"{', '.join(TORCH_DTYPES)}") from None
        self.num_layers = len(specs)
        self.groups = [_group(s, tuple(ls), dtype, tp, num_heads)
                       for s, ls in kv_cache_groups(specs)]
        # Bytes one more token costs while it is inside every window (the per-token figure
        # that sizes a block of the pool); a state's bytes are per request instead.
        self.kv_bytes_per_token = sum(len(g.layers) * g.bytes_per_token for g in self.groups)
        self.state_bytes_per_request = sum(len(g.layers) * g.state_bytes for g in self.groups)

    def stage_counts(self, begin: int, end: int) -> list[int]:
        """Layers of each group in ``[begin, end)`` (a pipeline stage)."""
        return [sum(begin <= i < end for i in g.layers) for g in self.groups]

    def held_bytes(self, context_len: int, block_size: int | None = None) -> float:
        """What one request of ``context_len`` tokens holds (whole blocks with
        ``block_size``)."""
        return sum(g.held_bytes(context_len, block_size) for g in self.groups)

    def max_batch(self, pool_bytes: float, context_len: int,
                  block_size: int | None = None) -> int:
        """Requests of ``context_len`` tokens that fit ``pool_bytes`` together."""
        per = self.held_bytes(context_len, block_size)
        return int(pool_bytes // per) if per > 0 else 0

    def decode_bytes(self, context_len: int) -> float:
        """KV bytes one request's decode step reads and writes (``context_len`` including the
        new token)."""
        return sum(len(g.layers) * (g.step_rows(1, context_len) * g.bytes_per_token
                                    + 2 * g.state_bytes) for g in self.groups)

    def describe(self, block_size: int) -> list[dict[str, Any]]:
        """Per group: its spec, layers, bytes per token and per block (all its layers)."""
        return [{"spec": spec_label(g.spec), "layers": list(g.layers),
                 "bytes_per_token": len(g.layers) * g.bytes_per_token,
                 "bytes_per_block": len(g.layers) * g.page_bytes(block_size),
                 **({"sliding_window": g.window} if g.window is not None else {}),
                 **({"state_bytes_per_request": len(g.layers) * g.state_bytes}
                    if g.is_state else {})}
                for g in self.groups]
