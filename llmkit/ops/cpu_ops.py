"""The CPU platform's ops: llmkit's C++ kernels (``torch.ops.llmkit_cpu``, ``kernels/cpu/``).

Each rounds exactly where the reference's op sequence rounds (RMSNorm, SiLU-and-mul and rotary
give its bits in float32 and bf16; bf16 decode attention follows SDPA's flash kernel), one call
instead of several dispatched ops each. ``paged_decode_attention`` reads K/V in place through
the block table, at any batch size. ``mla_decode_attention`` runs decode-only steps in the
C++ kernel (one latent row read per token for all heads; float32 sums in another order than the
reference's) and other steps (prefill chunks) in the torch reference.
"""
from __future__ import annotations

import torch

from llmkit.ops.base import ModelOps, RotaryTables
from llmkit.ops.moe import fused_moe_grouped


class CpuNativeOps(ModelOps):
    name = "cpu"
    paged_decode_in_place = True

    #: MoE experts with more tokens than this compute bf16 in float32 (``widen_bf16``).
    moe_widen_bf16_above = 8

    def __init__(self, kernels, *, widen_bf16: bool = False) -> None:
        self.kernels = kernels
        # bf16 models on CPUs without native bf16 (as CpuLinearMethod's widen_bf16)
        self.widen_bf16 = widen_bf16

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2:
            return self.kernels.rms_norm(x, weight, eps)
        shape = x.shape
        return self.kernels.rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps), residual

    def rotary(self, x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        self.kernels.rotary_embedding_(x, rope.cos_sin)
        return x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self.kernels.reshape_and_cache(k, v, kv_cache, slot_mapping)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
        return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, expert_map,
                                 self.moe_widen_bf16_above if self.widen_bf16 else -1)

    def ssm_state_update(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                         dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                         state_indices: torch.Tensor,
                         dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
        if ssm_state.dtype != torch.float32:  # the kernel keeps float32 states only
            return super().ssm_state_update(x, dt, A, B, C, D, dt_bias, ssm_state,
                                            state_indices, dt_limit)
        f32 = [t.float().contiguous() for t in (x, dt, A, B, C, D, dt_bias)]
        return self.kernels.ssm_state_update(*f32, ssm_state, state_indices.long(),
                                             float(dt_limit[0]), float(dt_limit[1]))

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, kv_cache, block_table, seq_lens, scale,
                                                   sliding_window or 0, soft_cap or 0.0)

    def write_latent_cache(self, latent: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if (latent.dtype != latent_cache.dtype or latent.dim() != 2 or latent.stride(-1) != 1
                or not slot_mapping.is_contiguous()):
            return super().write_latent_cache(latent, latent_cache, slot_mapping)
        self.kernels.write_latent_cache(latent, latent_cache, slot_mapping)

    def mla_decode_attention(self, q_latent: torch.Tensor, q_pe: torch.Tensor,
                             latent_cache: torch.Tensor, metadata, scale: float
                             ) -> torch.Tensor:
        n = metadata.num_actual_tokens
        dtype = q_latent.dtype
        if not (metadata.max_query_len == 1 and metadata.num_reqs == n
                and dtype in (torch.float32, torch.bfloat16)
                and q_pe.dtype == dtype and latent_cache.dtype == dtype):
            return super().mla_decode_attention(q_latent, q_pe, latent_cache, metadata, scale)
        out = self.kernels.mla_decode_attention(q_latent[:n], q_pe[:n], latent_cache,
                                                metadata.block_table[:n],
                                                metadata.seq_lens[:n], scale)
        if n == q_latent.shape[0]:
            return out
        padded = q_latent.new_zeros(q_latent.shape)  # a padded step's extra rows: 0
        padded[:n] = out
        return padded
