"""Portable attention over the paged cache with torch ops (the reference backend).

Decode rows (one query token) of a step run as one batched SDPA over K/V gathered through the
block table; prefill and chunked-prefill rows run one SDPA each, attending to their cached
prefix and causally to each other. Everything that depends only on the batch layout (which rows
decode, the gather indices, the masks) is built once per step in ``build_metadata``, not once
per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.ops.masking import attention, band_mask, window_start
from llmkit.kernels.kv_quant import read_rows
from llmkit.ops.base import write_kv


@dataclass(slots=True)
class DecodePlan:
    """Batched decode rows: their query rows, the flat cache slots of their context (padded to
    the longest) and the padding mask."""

    token_rows: torch.Tensor  # int64 [B]
    slots: torch.Tensor  # int64 [B * L] indices into the flattened cache
    mask: torch.Tensor  # bool [B, 1, 1, L]
    max_len: int

    def to(self, device: torch.device) -> "DecodePlan":
        return DecodePlan(self.token_rows.to(device), self.slots.to(device),
                          self.mask.to(device), self.max_len)


@dataclass(slots=True)
class PrefillPlan:
    start: int
    end: int
    slots: torch.Tensor  # int64 [seq_len]
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None = plain causal

    def to(self, device: torch.device) -> "PrefillPlan":
        return PrefillPlan(self.start, self.end, self.slots.to(device),
                           None if self.mask is None else self.mask.to(device))


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    decode: DecodePlan | None = None
    prefills: list[PrefillPlan] | None = None
    # {sliding_window: (decode, prefills)}: the plans restricted to a window, made by the
    # first layer with that window and shared by the others
    windowed: dict = field(default_factory=dict)


def windowed_decode_plan(d: DecodePlan, sliding_window: int) -> DecodePlan:
    """``d`` restricted to each row's last ``sliding_window`` positions: the gather reads no
    slot before a row's window (the padding repeats the row's last slot)."""
    b = d.token_rows.shape[0]
    lens = d.mask.view(b, -1).sum(-1)
    start = (lens - sliding_window).clamp(min=0)
    width = min(sliding_window, d.max_len)
    j = torch.arange(width, device=lens.device)
    pos = torch.minimum(start[:, None] + j[None, :], (lens - 1).clamp(min=0)[:, None])
    slots = d.slots.view(b, -1).gather(1, pos)
    mask = (j[None, :] < (lens - start)[:, None])[:, None, None, :]
    return DecodePlan(d.token_rows, slots.reshape(-1), mask, width)


def windowed_prefill_plan(p: PrefillPlan, sliding_window: int) -> PrefillPlan:
    """``p`` reading only the keys its queries' windows reach, with the band mask."""
    q_len, kv_len = p.end - p.start, p.slots.shape[0]
    lo = window_start(kv_len, q_len, sliding_window)
    dev = p.slots.device
    mask = band_mask(torch.arange(kv_len - q_len, kv_len, device=dev),
                     torch.arange(lo, kv_len, device=dev), sliding_window)
    return PrefillPlan(p.start, p.end, p.slots[lo:], mask)


def plans_for_window(m, sliding_window: int | None):
    """``(decode, prefills)`` of ``m`` (a metadata with gathered plans and a ``windowed``
    cache) for a layer with ``sliding_window``; the step's own plans when the window reaches
    past every row's context."""
    if sliding_window is None or 0 < m.max_seq_len <= sliding_window:
        return m.decode, m.prefills
    plans = m.windowed.get(sliding_window)
    if plans is None:
        d = m.decode
        if isinstance(d, DecodePlan):
            d = windowed_decode_plan(d, sliding_window)
        plans = m.windowed[sliding_window] = (
            d, [windowed_prefill_plan(p, sliding_window) for p in m.prefills or ()])
    return plans


def _context_slots(block_ids: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return block_ids[pos // block_size].long() * block_size + pos % block_size


def gathered_decode_attention(q: torch.Tensor, flat_cache: torch.Tensor, d: DecodePlan,
                              scale: float, soft_cap: float | None = None) -> torch.Tensor:
    """Decode rows' attention over their context gathered from ``flat_cache [2, slots, Hkv, D]``
    into a padded ``[B, L]`` batch: ``[B, H, D]``."""
    b, num_kv_heads, head_dim = d.token_rows.shape[0], flat_cache.shape[-2], q.shape[-1]
    keys = read_rows(flat_cache[0].index_select(0, d.slots), q.dtype).view(
        b, d.max_len, num_kv_heads, head_dim)
    vals = read_rows(flat_cache[1].index_select(0, d.slots), q.dtype).view(
        b, d.max_len, num_kv_heads, head_dim)
    o = attention(
        q[d.token_rows].unsqueeze(2), keys.transpose(1, 2), vals.transpose(1, 2),
        attn_mask=d.mask, is_causal=False, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads, soft_cap=soft_cap)
    return o.squeeze(2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    kv_cache_dtypes = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8", "int8")

    def build_metadata(self, m: AttentionMetadata) -> TorchAttentionMetadata:
        qsl, seq_lens, bs = m.query_start_loc_cpu, m.seq_lens_cpu, m.block_size
        decode_rows = [i for i in range(m.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        decode = None
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.long)
            lens = m.seq_lens[rows].long()
            max_len = int(max(seq_lens[i] for i in decode_rows))
            pos = torch.arange(max_len)
            nblk = -(-max_len // bs)
            blocks = m.block_table[rows, :nblk].long()  # [B, nblk]
            slots = blocks[:, pos // bs] * bs + pos % bs  # [B, L]
            decode = DecodePlan(
                token_rows=torch.tensor([qsl[i] for i in decode_rows], dtype=torch.long),
                slots=slots.reshape(-1),
                mask=(pos[None, :] < lens[:, None])[:, None, None, :],
                max_len=max_len,
            )
        prefills = []
        if len(decode_rows) != m.num_reqs:
            decode_set = set(decode_rows)
            for i in range(m.num_reqs):
                start, end = qsl[i], qsl[i + 1]
                if i in decode_set or end == start:
                    continue
                q_len, kv_len = end - start, seq_lens[i]
                mask = None
                if q_len != kv_len:  # a chunk after a cached prefix: causal with an offset
                    mask = (torch.arange(kv_len)[None, :]
                            <= torch.arange(q_len)[:, None] + (kv_len - q_len))
                prefills.append(PrefillPlan(start, end,
                                            _context_slots(m.block_table[i], kv_len, bs), mask))
        fields = m.base_fields()
        return TorchAttentionMetadata(**fields, decode=decode, prefills=prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        if not isinstance(metadata, TorchAttentionMetadata):
            metadata = self.build_metadata(metadata)
        if metadata.slot_mapping.device != kv_cache.device:
            self._move_plans(metadata, kv_cache.device)  # once per step, by the first layer
        n = metadata.num_actual_tokens
        write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n])
        num_kv_heads = kv_cache.shape[-2]
        flat = kv_cache.view(2, -1, num_kv_heads, kv_cache.shape[-1])  # rows: see kv_quant
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)
        d, prefills = plans_for_window(metadata, sliding_window)
        if d is not None:
            out[d.token_rows] = gathered_decode_attention(q, flat, d, scale, logits_soft_cap)
        for p in prefills or ():
            kc = read_rows(flat[0].index_select(0, p.slots), q.dtype).transpose(0, 1)
            vc = read_rows(flat[1].index_select(0, p.slots), q.dtype).transpose(0, 1)
            qt = q[p.start:p.end].transpose(0, 1)
            o = attention(qt, kc, vc, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                          enable_gqa=gqa, soft_cap=logits_soft_cap)
            out[p.start:p.end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _move_plans(m: TorchAttentionMetadata, device: torch.device) -> None:
        """The runner builds metadata on the host; plans follow the cache to its device."""
        m.slot_mapping = m.slot_mapping.to(device)
        if m.decode is not None:
            m.decode = m.decode.to(device)
        if m.prefills:
            m.prefills = [p.to(device) for p in m.prefills]
