"""What every Triton attention kernel does to read the paged KV cache: load a tile of K and V
rows in place, dequantizing a quantized cache (``kv_quant``) as it loads."""
from __future__ import annotations

import triton.language as tl

from llmkit.kernels._jit import device_function


@device_function
def load_kv_tile(cache_ptr, scale_ptr, head_off, tok, n_ok, offs_d, d_ok, stride_c_kv,
                 HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """K and V ``[BLOCK_N, BLOCK_D]`` of the cache rows at ``head_off + tok`` (elements into
    the layer cache: the KV head's offset, each token's block and slot; ``n_ok`` masks tokens,
    ``d_ok`` the head dimension). A float cache's rows come in its dtype; with ``QUANT`` (1
    int8, 2 e4m3, see ``kv_quant.quant_args``) codes times each row's scale, in float32."""
    kv_base = cache_ptr + head_off
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(kv_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0)
    v = tl.load(kv_base + stride_c_kv + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0)
    if QUANT != 0:
        # kv_quant rows: codes, then the row's float32 scale at byte HEAD_DIM
        at = (head_off + tok + HEAD_DIM) // 4
        k_scale = tl.load(scale_ptr + at, mask=n_ok, other=0.0)
        v_scale = tl.load(scale_ptr + at + stride_c_kv // 4, mask=n_ok, other=0.0)
        if QUANT == 2:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(tl.float32) * k_scale[:, None]
        v = v.to(tl.float32) * v_scale[:, None]
    return k, v


@device_function
def soft_capped_log2(s, sm_scale_log2, soft_cap):
    """Raw dot products ``s`` to soft-capped scores in the log2 domain:
    ``c * tanh(s * scale / c) * log2(e)`` (Gemma 2; ``sm_scale_log2`` is ``scale * log2(e)``).
    tanh from exp2 of a non-positive argument, which cannot overflow."""
    x = s * (sm_scale_log2 / 1.4426950408889634) / soft_cap
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * (soft_cap * 1.4426950408889634)
