"""The CUDA platform's ops: llmkit's Triton kernels (``llmkit.kernels``), each with a torch
reference beside it. On a CPU they run only under ``TRITON_INTERPRET=1`` (tests)."""
from __future__ import annotations

import torch

from llmkit import kernels
from llmkit.ops.base import ModelOps, RotaryTables


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
