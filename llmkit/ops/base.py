"""Platform ops: the small operators a model and its attention backend are written over.

``ModelOps`` is the interface *and* the portable torch reference (the numerics of Hugging Face's
op sequence); a platform hands a model its own subclass: llmkit's C++ kernels on CPUs
(``cpu_ops.py``), Triton kernels on CUDA (``triton_ops.py``). A model never asks which machine
it runs on: it calls ``self.ops.<op>``.

Conventions: activations are ``[tokens, hidden]`` (or ``[tokens, heads, head_dim]``); the KV
cache of a layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (rows of
``head_dim + 4`` bytes for a quantized cache: ``llmkit.kernels.kv_quant``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmkit.ops.mamba import (RecurrentBatch, causal_conv1d_reference, ssd_scan_reference,
                              ssm_state_update)
from llmkit.ops.masking import attention
from llmkit.ops.mla import MLAStepLayout, mla_decode_attention_reference, write_latent_cache
from llmkit.ops.moe import fused_moe_grouped, fused_topk
from llmkit.kernels.kv_quant import read_rows, to_cache_rows


@dataclass(slots=True)
class RotaryTables:
    """One step's rotary tables, looked up once and shared by every layer: ``cos_sin
    [tokens, rot_dim]`` (cos of each frequency in the first half, sin in the second) and its
    halves as ``cos, sin [tokens, 1, rot_dim // 2]`` views."""

    cos_sin: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class ModelOps:
    """The torch reference of every op (also the interface platforms override)."""

    name = "torch"
    #: True when ``paged_decode_attention`` reads K/V in place through the block table at any
    #: batch size (a backend may then send every decode row to it); the reference gathers.
    paged_decode_in_place = False

    # -- norms -------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Hugging Face's RMSNorm: normalise in float32, cast back, then scale by ``weight``."""
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        h = x.float()
        scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
        h = h.mul_(scale) if h.data_ptr() != x.data_ptr() else h * scale
        return h.to(x.dtype).mul_(weight)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` in place, then ``(rms_norm(residual), residual)``."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps), residual

    # -- rotary, activation ----------------------------------------------------------------
    def rotary(self, x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        """``x [tokens, heads, head_dim]`` rotated (neox layout), in place where the platform
        can (then ``x`` itself is returned); the reference returns a new tensor."""
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, rope.cos, out=o1)
        o1.addcmul_(x2, rope.sin, value=-1)
        torch.mul(x2, rope.cos, out=o2)
        o2.addcmul_(x1, rope.sin)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d``."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])

    # -- mixture of experts (``llmkit/ops/moe.py`` has the shapes) ------------------------
    def moe_topk(self, router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice: ``(weights float32 [T, k], expert ids int32 [T, k])``."""
        return fused_topk(router_logits, top_k, renormalize)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts' weighted sum for every token: ``[T, H]`` in ``x``'s dtype
        (tokens grouped by expert, one GEMM pair per active expert)."""
        return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, expert_map)

    # -- recurrent state (Mamba-2; ``llmkit/ops/mamba.py`` has the shapes) ------------------
    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, batch: RecurrentBatch,
                      activation: str | None = "silu") -> torch.Tensor:
        """Each request's causal depthwise conv over its carried inputs and this step's
        (``x [T, C]`` -> ``[T, C]``); ``conv_state`` is left holding each one's last inputs."""
        return causal_conv1d_reference(x, weight, bias, conv_state, batch, activation)

    def ssd_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                 ssm_state: torch.Tensor, batch: RecurrentBatch, chunk_size: int,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
        """Each request's selective-state scan from its carried state (``x [T, H, P]`` ->
        ``y [T, H, P]`` float32); one-token rows take :meth:`ssm_state_update`."""
        return ssd_scan_reference(x, dt, A, B, C, D, dt_bias, ssm_state, batch, chunk_size,
                                  dt_limit, update=self.ssm_state_update)

    def ssm_state_update(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                         dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor,
                         dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
        """The decode step of the scan, in place on ``ssm_state[state_indices]``: ``x [R, H,
        P]`` -> ``[R, H, P]`` float32."""
        return ssm_state_update(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_limit)

    # -- KV cache ----------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store ``k, v [tokens, kv_heads, head_dim]`` at ``slot_mapping`` (-1 = skip)."""
        write_kv(k, v, kv_cache, slot_mapping)

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> torch.Tensor:
        """One query token per row over its paged context: ``q [B, H, D]`` -> ``[B, H, D]``;
        grouped-query heads share their K/V head; float32 math like SDPA's CPU kernel.
        ``sliding_window``: each row sees its last W positions only, and reads no block before
        them; ``soft_cap``: scores ``c * tanh(s / c)`` (``llmkit.ops.masking``)."""
        return paged_decode_attention_reference(q, kv_cache, block_table, seq_lens, scale,
                                                sliding_window, soft_cap)

    # -- multi-head latent attention (MLA; ``llmkit/ops/mla.py``) --------------------------
    def write_latent_cache(self, latent: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Store ``latent [T, latent_dim]`` (per token: normalized ``c_kv`` then roped ``k_pe``)
        into ``latent_cache [num_blocks, block_size, latent_dim]`` at ``slot_mapping [n]``
        (flat slot ``block * block_size + offset``; -1 = skip; rows ``n..T`` of ``latent`` are
        not read), cast to the cache's dtype. A quantized cache is refused (``ConfigError``
        naming ``kv_cache.cache_dtype``; at start-up ``worker.kv_cache_setup.plan_kv_cache``
        refuses it for an MLA model)."""
        write_latent_cache(latent, latent_cache, slot_mapping)

    def mla_decode_attention(self, q_latent: torch.Tensor, q_pe: torch.Tensor,
                             latent_cache: torch.Tensor, metadata: MLAStepLayout,
                             scale: float) -> torch.Tensor:
        """Absorbed MLA attention over the paged latent cache: ``[T, H, kv_lora_rank]``.

        ``q_latent [T, H, kv_lora_rank]`` (``q_nope`` times ``W_UK`` per head),
        ``q_pe [T, H, rope_dim]`` (roped), ``latent_cache [N, block_size, kv_lora_rank +
        rope_dim]`` (this step's rows already written: ``write_latent_cache`` first),
        ``metadata`` the layer's ``AttentionMetadata`` (``attn_metadata.for_layer(i)``).
        Query row t of request i (rows ``query_start_loc[i]:query_start_loc[i+1]``) sits at
        position ``p = seq_lens[i] - q_len_i + (t - query_start_loc[i])`` and attends over the
        request's cached positions ``0..p`` (causal: prefill chunks and decode rows alike),
        read through ``block_table[i]``. With ``c_kv = row[:kv_lora_rank]`` and
        ``k_pe = row[kv_lora_rank:]``, head h's score at position j is
        ``scale * (q_latent[t, h] . c_kv_j + q_pe[t, h] . k_pe_j)``; the output is
        ``sum_j softmax(score)_j * c_kv_j`` in ``q_latent``'s dtype (the model applies
        ``W_UV``). Math in float32. Rows ``num_actual_tokens..T`` (padding) come back 0.

        A decode-only step (``max_query_len == 1``, one row per request) reads only the
        tensors ``block_table`` and ``seq_lens`` (a step graph's decode metadata serves);
        other steps also read ``query_start_loc_cpu`` and ``seq_lens_cpu``. Platforms run
        decode-only steps in their kernels (one latent row read serves all H heads); their
        sums may be ordered differently from this reference (float32 rounding only)."""
        return mla_decode_attention_reference(q_latent, q_pe, latent_cache, metadata, scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, has_skipped_slots: bool | None = None) -> None:
    """Store this step's K/V at their slots in the paged cache (slot -1 is skipped), quantized
    where the cache is (``llmkit.kernels.kv_quant``). ``has_skipped_slots``: whether any slot is
    -1, when the caller knows (else it is checked, which costs a host sync per call)."""
    flat = kv_cache.view(2, -1, k.shape[1], kv_cache.shape[-1])
    n = slot_mapping.shape[0]
    if has_skipped_slots is None:
        has_skipped_slots = bool(n and (slot_mapping < 0).any())
    if n and has_skipped_slots:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[:n][keep], v[:n][keep]
    n = slot_mapping.shape[0]
    flat[0].index_copy_(0, slot_mapping, to_cache_rows(k[:n], flat.dtype))
    flat[1].index_copy_(0, slot_mapping, to_cache_rows(v[:n], flat.dtype))


def paged_decode_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor,
                                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention with K/V gathered through the block table (the reference: simple, and
    as fast as anything in torch ops for a few rows). ``block_table [B, nb]`` entries past a
    row's length may be any valid block; with ``sliding_window`` entries before a row's window
    may be anything (never read)."""
    if sliding_window is not None or soft_cap is not None:
        return _windowed_decode_reference(q, kv_cache, block_table, seq_lens, scale,
                                          sliding_window, soft_cap)
    b, h, d = q.shape
    hkv, bs = kv_cache.shape[3], kv_cache.shape[2]
    nb = block_table.shape[1]
    k = read_rows(kv_cache[0][block_table.long()], torch.float32).reshape(b, nb * bs, hkv, d)
    v = read_rows(kv_cache[1][block_table.long()], torch.float32).reshape(b, nb * bs, hkv, d)
    valid = torch.arange(nb * bs, device=q.device)[None, :] < seq_lens.view(b, 1).long()
    o = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=h != hkv)
    return o.squeeze(2).to(q.dtype)


def _windowed_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None,
                               soft_cap: float | None) -> torch.Tensor:
    """The reference with a window (each row gathers only its last W positions' slots) and/or
    soft-capped scores, in float32."""
    b, h, d = q.shape
    hkv, bs = kv_cache.shape[3], kv_cache.shape[2]
    lens = seq_lens.view(b).long()
    width = block_table.shape[1] * bs
    if sliding_window is not None:
        width = min(width, sliding_window)
    start = (lens - width).clamp(min=0)
    j = torch.arange(width, device=q.device)
    pos = torch.minimum(start[:, None] + j[None, :], (lens - 1).clamp(min=0)[:, None])
    blocks = block_table.long().gather(1, pos // bs)
    slots = (blocks * bs + pos % bs).reshape(-1)
    flat = kv_cache.view(2, -1, hkv, kv_cache.shape[-1])
    k = read_rows(flat[0].index_select(0, slots), torch.float32).view(b, width, hkv, d)
    v = read_rows(flat[1].index_select(0, slots), torch.float32).view(b, width, hkv, d)
    valid = j[None, :] < (lens - start)[:, None]
    o = attention(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                  attn_mask=valid[:, None, None, :], is_causal=False, scale=scale,
                  enable_gqa=h != hkv, soft_cap=soft_cap)
    return o.squeeze(2).to(q.dtype)
