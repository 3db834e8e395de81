"""Portable attention over the paged cache with torch ops (the reference backend).

Decode rows (one query token) of a step run as one batched SDPA over K/V gathered through the
block table; prefill and chunked-prefill rows run one SDPA each, attending to their cached
prefix and causally to each other.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmkit.attention.base import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V at their slots in the paged cache (slot -1 is skipped)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    n = slot_mapping.shape[0]
    if n and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[:n][keep], v[:n][keep]
    flat[0].index_copy_(0, slot_mapping, k[: slot_mapping.shape[0]].to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v[: slot_mapping.shape[0]].to(flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens: ``[length, num_kv_heads, head_dim]``."""
    block_size = kv_cache.shape[2]
    nblk = (length + block_size - 1) // block_size
    ids = block_ids[:nblk]
    k = kv_cache[0, ids].flatten(0, 1)[:length]
    v = kv_cache[1, ids].flatten(0, 1)[:length]
    return k, v


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        n = metadata.num_actual_tokens
        write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n])
        out = torch.empty_like(q)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        decode_rows = [i for i in range(metadata.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        if decode_rows:
            self._decode(q, out, kv_cache, metadata, decode_rows, scale)
        if len(decode_rows) != metadata.num_reqs:
            decode_set = set(decode_rows)
            for i in range(metadata.num_reqs):
                if i in decode_set:
                    continue
                start, end = qsl[i], qsl[i + 1]
                if end == start:
                    continue
                kc, vc = gather_kv(kv_cache, metadata.block_table[i], seq_lens[i])
                out[start:end] = _prefill_attention(q[start:end], kc, vc, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, rows: list[int], scale: float) -> None:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        block_size = kv_cache.shape[2]
        max_len = max(seq_lens[i] for i in rows)
        nblk = (max_len + block_size - 1) // block_size
        tok_idx = torch.tensor([qsl[i] for i in rows], dtype=torch.long)
        row_idx = torch.tensor(rows, dtype=torch.long)
        blocks = metadata.block_table[row_idx, :nblk].long()  # [B, nblk]
        keys = kv_cache[0][blocks].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
        vals = kv_cache[1][blocks].flatten(1, 2)[:, :max_len]
        lens = torch.tensor([seq_lens[i] for i in rows])
        mask = torch.arange(max_len)[None, :] < lens[:, None]  # [B, L]
        qb = q[tok_idx].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qb, keys.transpose(1, 2).to(q.dtype), vals.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None, None, :], scale=scale,
            enable_gqa=q.shape[1] != keys.shape[2])
        out[tok_idx] = o.squeeze(2)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Queries are the last ``len(q)`` of ``len(k)`` positions: causal with an offset."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if q_len == kv_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        offset = kv_len - q_len
        mask = torch.arange(kv_len)[None, :] <= (torch.arange(q_len)[:, None] + offset)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)
