"""The CUDA platform's ops: llmkit's Triton kernels (``llmkit.kernels``), each with a torch
reference beside it. On a CPU they run only under ``TRITON_INTERPRET=1`` (tests)."""
from __future__ import annotations

import torch

from llmkit import kernels
from llmkit.ops.base import ModelOps, RotaryTables
from llmkit.ops.mla import MLAStepLayout


class TritonOps(ModelOps):
    name = "triton"
    paged_decode_in_place = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        return kernels.rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        # The kernel rotates two head groups at once (q and k); one group here, and the
        # step's tables are already looked up, so token t reads row t.
        positions = torch.arange(x.shape[0], device=x.device)
        kernels.rotary_embedding(positions, x, x[:, :0], rope.cos_sin)
        return x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kernels.reshape_and_cache(k, v, kv_cache, slot_mapping)

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> torch.Tensor:
        return kernels.paged_decode_attention(q, kv_cache, block_table, seq_lens, scale,
                                              sliding_window=sliding_window, soft_cap=soft_cap)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map)

    def write_latent_cache(self, latent: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if latent.dtype != latent_cache.dtype or latent.stride(-1) != 1:
            return super().write_latent_cache(latent, latent_cache, slot_mapping)
        kernels.write_latent_cache(latent, latent_cache, slot_mapping)

    def mla_decode_attention(self, q_latent: torch.Tensor, q_pe: torch.Tensor,
                             latent_cache: torch.Tensor, metadata: MLAStepLayout,
                             scale: float) -> torch.Tensor:
        # Decode-only steps in the kernel; prefill chunks (several causal queries per request)
        # in the reference.
        n = metadata.num_actual_tokens
        if not (metadata.max_query_len == 1 and metadata.num_reqs == n
                and q_pe.dtype == q_latent.dtype == latent_cache.dtype):
            return super().mla_decode_attention(q_latent, q_pe, latent_cache, metadata, scale)
        out = torch.zeros_like(q_latent)  # a padded step's extra rows: 0
        if n == 0:
            return out
        from llmkit.kernels.mla_attention import BLOCK_H

        splits = kernels.device_num_splits(q_latent.device, n,
                                           -(-q_latent.shape[1] // BLOCK_H),
                                           max(metadata.max_seq_len, 1))
        block_table, seq_lens = _on_device(metadata, latent_cache.device)
        kernels.mla_decode_attention(q_latent[:n], q_pe[:n], latent_cache, block_table[:n],
                                     seq_lens[:n], scale, num_splits=splits, out=out[:n])
        return out


def _on_device(metadata: MLAStepLayout, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's block table and lengths on the cache's device: the runner builds them on the
    host; moved once per step (the first layer's copy kept in ``metadata.derived``)."""
    key = ("mla_tables", str(device))
    tables = metadata.derived.get(key)
    if tables is None:
        tables = metadata.derived[key] = (metadata.block_table.to(device, non_blocking=True),
                                          metadata.seq_lens.to(device, non_blocking=True))
    return tables
