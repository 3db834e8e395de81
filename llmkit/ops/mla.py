"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the paged latent cache: the torch
reference of the two platform ops ``ModelOps.write_latent_cache`` and
``ModelOps.mla_decode_attention``.

An MLA layer caches one latent row per token, shared by every head (``MLASpec``):
``latent_cache [num_blocks, block_size, latent_dim]``, ``latent_dim = kv_lora_rank +
qk_rope_head_dim``, each row the normalized ``c_kv`` (first ``kv_lora_rank`` values) followed by
the roped ``k_pe``. Attention runs in the "absorbed" form: the model folds ``W_UK`` into the
query (``q_latent = q_nope @ W_UK`` per head) and applies ``W_UV`` to the output, so a head's
score against a cached token is ``q_latent . c_kv + q_pe . k_pe`` and its output is the
softmax-weighted sum of ``c_kv`` rows: one latent row read serves every head.
"""
from __future__ import annotations

from typing import Any, Hashable, Protocol

import torch

from llmkit.config.errors import ConfigError
from llmkit.kernels.kv_quant import format_of


class MLAStepLayout(Protocol):
    """What the MLA ops read of a step's batch layout. ``llmkit.attention.base.AttentionMetadata``
    (a layer's ``attn_metadata.for_layer(i)``) is one; the ops name this protocol, not it, since
    the attention backends are written over the ops and the arrow runs only that way."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # what the first layer derives from the step for the others (device copies of the tables)
    derived: dict[Hashable, Any]


def check_mla_cache_dtype(storage_dtype: torch.dtype) -> None:
    """Refuse a quantized latent cache (int8 / fp8 rows with scales: ``kv_quant``), which no
    MLA reader dequantizes; a float cache of any float dtype is read (cast to float32)."""
    fmt = format_of(storage_dtype)
    if fmt is not None:
        raise ConfigError("kv_cache.cache_dtype", fmt.name,
                          "auto, bfloat16 or float16 for MLA models (the latent cache is not "
                          "quantized)")


def write_latent_cache(latent: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store ``latent [T, latent_dim]`` rows at ``slot_mapping [n]`` (flat slot = block *
    block_size + offset; -1 = skip) of ``latent_cache [N, block_size, latent_dim]``, cast to
    the cache's dtype. Only the first ``n = len(slot_mapping)`` rows of ``latent`` are read
    (a padded step's extra rows are not)."""
    check_mla_cache_dtype(latent_cache.dtype)
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    n = slot_mapping.shape[0]
    rows = latent[:n]
    if n and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, rows = slot_mapping[keep], rows[keep]
    flat.index_copy_(0, slot_mapping.long(), rows.to(flat.dtype))


def _attend(q_latent: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
            visible: torch.Tensor, scale: float) -> torch.Tensor:
    """``q_latent [B, Q, H, R]``, ``q_pe [B, Q, H, P]`` against latent ``rows [B, L, R + P]``
    where ``visible [B, Q, L]``: float32 ``[B, Q, H, R]``; a query that sees nothing gets 0."""
    r = q_latent.shape[-1]
    c_kv, k_pe = rows[..., :r], rows[..., r:]
    s = (torch.einsum("bqhr,blr->bqhl", q_latent.float(), c_kv)
         + torch.einsum("bqhp,blp->bqhl", q_pe.float(), k_pe)) * scale
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an all-masked row's NaNs -> 0
    return torch.einsum("bqhl,blr->bqhr", p, c_kv)


def mla_decode_attention_reference(q_latent: torch.Tensor, q_pe: torch.Tensor,
                                   latent_cache: torch.Tensor, metadata: MLAStepLayout,
                                   scale: float
                                   ) -> torch.Tensor:
    """The torch reference of ``ModelOps.mla_decode_attention`` (float32 math; see there).

    A decode-only step (``metadata.max_query_len == 1`` and one row per request) runs batched
    from tensors alone (``block_table``, ``seq_lens``: no host copies, so a step graph's decode
    metadata serves); any other step runs request by request from the host copies
    (``query_start_loc_cpu``, ``seq_lens_cpu``)."""
    check_mla_cache_dtype(latent_cache.dtype)
    t, h, r = q_latent.shape
    bs, dim = latent_cache.shape[1], latent_cache.shape[2]
    assert q_pe.shape[:2] == (t, h) and r + q_pe.shape[2] == dim, (
        f"q_latent {tuple(q_latent.shape)} + q_pe {tuple(q_pe.shape)} vs latent_cache "
        f"{tuple(latent_cache.shape)}")
    out = q_latent.new_zeros(t, h, r)
    n = metadata.num_actual_tokens
    if n == 0:
        return out
    flat = latent_cache.view(-1, dim)
    device = q_latent.device
    if metadata.max_query_len == 1 and metadata.num_reqs == n:
        # Every block of each row's table, masked past its length (no host sync).
        table = metadata.block_table[:n].to(device).long()
        nb = table.shape[1]
        pos = torch.arange(nb * bs, device=device)
        slots = (table[:, pos // bs] * bs + pos % bs).clamp_(0, flat.shape[0] - 1)
        rows = flat[slots].float()  # [n, nb * bs, dim]
        visible = (pos[None, :] < metadata.seq_lens[:n].to(device).long()[:, None])[:, None]
        o = _attend(q_latent[:n, None], q_pe[:n, None], rows, visible, scale)
        out[:n] = o[:, 0].to(out.dtype)
        return out
    qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i in range(metadata.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        q_len, kv_len = end - start, lens[i]
        if q_len == 0:
            continue
        pos = torch.arange(kv_len, device=device)
        slots = metadata.block_table[i].to(device).long()[pos // bs] * bs + pos % bs
        rows = flat.index_select(0, slots).float()
        # query j of the chunk sits at position kv_len - q_len + j and sees positions <= it
        q_pos = torch.arange(q_len, device=device) + (kv_len - q_len)
        visible = pos[None, :] <= q_pos[:, None]
        o = _attend(q_latent[None, start:end], q_pe[None, start:end], rows[None],
                    visible[None], scale)
        out[start:end] = o[0].to(out.dtype)
    return out
