"""Multi-head latent attention (DeepSeek-V2/V3), over a latent KV cache.

Each token's keys and values come from one compressed vector: ``kv_a_proj_with_mqa`` gives
``c_kv [kv_lora_rank]`` (normalised by ``kv_a_layernorm``) and one roped key part ``k_pe
[qk_rope_head_dim]`` shared by every head; ``kv_b_proj`` expands ``c_kv`` per head into the
key's non-rotary part (``W_UK``) and the value (``W_UV``). The cache keeps the latent row
``[c_kv, k_pe]`` only (``MLASpec``).

Absorbed (the default): ``q_nope · W_UK[h]`` moves the query into the latent space, attention
runs over the latent rows (``ModelOps.mla_decode_attention``: scores ``q_latent · c_kv + q_pe ·
k_pe``, the output a weighted sum of the ``c_kv`` rows), and ``W_UV[h]`` maps each head's result
back to ``v_head_dim`` before ``o_proj``. The same op serves prefill and decode.

Expanded (``model.mla=expanded``, a comparison point): K and V per head are materialised and
cached like any full-attention layer (``FullAttentionSpec``), run by the attention backend; V is
zero-padded to K's width (``qk_nope_head_dim + qk_rope_head_dim``) because a cache tensor holds
one head width.

Rotary: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
(DeepSeek-V2 always; V3 with ``rope_interleave``). The loader permutes the rope rows of the q
and kv_a projections (evens, then odds: :func:`deinterleave_rows`), after which llmkit's
neox-layout rotary computes the same rotation; attention scores are unchanged by a permutation
applied to both queries and keys.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import FullAttentionSpec, KVCacheSpec, MLASpec
from llmkit.models.layers.context import ModelContext
from llmkit.models.layers.linear import Linear
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.rotary import rope_parameters
from llmkit.ops.base import RotaryTables

MLA_MODES = ("absorbed", "expanded")
# DeepSeek's q_a / kv_a layernorms use RMSNorm's default epsilon, not config.rms_norm_eps
# (transformers and DeepSeek's own code alike).
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled
    rope with ``mscale_all_dim`` (YaRN's attention temperature for the whole head; the rope
    part's own share is folded into the cos/sin table's attention factor)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


def deinterleave_rows(w: torch.Tensor, offset: int, block: int, rope_dim: int) -> torch.Tensor:
    """``w`` with the rope rows of every ``block``-row head (rows ``offset .. offset +
    rope_dim`` of it) reordered evens then odds: interleaved rotary pairs become neox halves."""
    perm = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)]) + offset
    heads = w.shape[0] // block
    index = torch.arange(w.shape[0]).view(heads, block)
    index[:, offset:offset + rope_dim] = perm + torch.arange(heads).view(heads, 1) * block
    return w.index_select(0, index.reshape(-1))


class MLAAttention(nn.Module):
    def __init__(self, config, prefix: str, ctx: ModelContext, mode: str = "absorbed") -> None:
        super().__init__()
        if mode not in MLA_MODES:
            raise ValueError(f"MLA mode {mode!r}; allowed: {', '.join(MLA_MODES)}")
        self.mode = mode
        self.ops = ctx.ops
        self.attn_backend = ctx.attn_backend
        heads = config.num_attention_heads
        if heads % ctx.tp.size:
            raise ValueError(f"{heads} attention heads do not split over {ctx.tp.size} "
                             "tensor-parallel ranks")
        self.num_heads = heads // ctx.tp.size
        # what the cache keeps per token: every head's K/V (expanded) or one latent row
        self.num_kv_heads = self.num_heads if mode == "expanded" else 1
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = softmax_scale(config)
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size

        def linear(name: str, n_in: int, n_out: int, parallel: str = "replicated",
                   has_bias: bool = False) -> Linear:
            return Linear.build(f"{prefix}.{name}", n_in, n_out, bias=has_bias, dtype=ctx.dtype,
                                linear_method=ctx.linear_method, parallel=parallel)

        # q: hidden -> (rank q_lora_rank, normalised ->) heads x (nope + rope); column-split
        # by heads under tensor parallel, like kv_b_proj; the latent projections replicate.
        if self.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, heads * self.qk_dim, "column")
        else:
            self.q_a_proj = linear("q_a_proj", hidden, self.q_lora_rank, has_bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, ctx.dtype, ctx.ops)
            self.q_b_proj = linear("q_b_proj", self.q_lora_rank, heads * self.qk_dim, "column")
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden,
                                         self.kv_lora_rank + self.rope_dim, has_bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ctx.dtype, ctx.ops)
        self.kv_b_proj = linear("kv_b_proj", self.kv_lora_rank,
                                heads * (self.nope_dim + self.v_dim), "column")
        self.o_proj = Linear.build(f"{prefix}.o_proj", heads * self.v_dim, hidden, bias=bias,
                                   dtype=ctx.dtype, linear_method=ctx.linear_method,
                                   parallel="row")
        # absorbed: kv_b_proj's halves per head, [h, nope, rank] and [h, v, rank]
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        # expanded: one head width for K and (zero-padded) V
        self.expanded_dim = max(self.qk_dim, self.v_dim)

    def kv_cache_spec(self) -> KVCacheSpec:
        if self.mode == "absorbed":
            return MLASpec(self.kv_lora_rank, self.rope_dim)
        return FullAttentionSpec(self.num_heads, self.expanded_dim)

    def absorb_weights(self) -> None:
        """Split ``kv_b_proj``'s dense weight into ``W_UK`` / ``W_UV`` (before its linear
        method repacks it)."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim,
                                                self.kv_lora_rank)
        self.w_uk = w[:, :self.nope_dim].contiguous()
        self.w_uv = w[:, self.nope_dim:].contiguous()

    def forward(self, x: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, h, self.qk_dim)
        q_nope = q[..., :self.nope_dim]
        q_pe = self.ops.rotary(q[..., self.nope_dim:].contiguous(), rope)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :self.kv_lora_rank].contiguous())
        k_pe = self.ops.rotary(kv[:, self.kv_lora_rank:].contiguous().view(n, 1, self.rope_dim),
                               rope)
        if self.mode == "expanded":
            o = self._expanded(q_nope, q_pe, c_kv, k_pe, kv_cache, attn_metadata)
        else:
            latent = torch.cat([c_kv, k_pe.view(n, self.rope_dim)], dim=-1)
            self.ops.write_latent_cache(latent, kv_cache, attn_metadata.slot_mapping)
            # [h, n, nope] x [h, nope, rank]: each head's query in the latent space
            q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            o_latent = self.ops.mla_decode_attention(q_latent, q_pe, kv_cache, attn_metadata,
                                                     self.scale)
            # [h, n, rank] x [h, rank, v]: back to each head's value space
            o = torch.bmm(o_latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(o.reshape(n, h * self.v_dim))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                  k_pe: torch.Tensor, kv_cache: torch.Tensor,
                  attn_metadata: AttentionMetadata) -> torch.Tensor:
        n, h = q_nope.shape[0], self.num_heads
        kv = self.kv_b_proj(c_kv).view(n, h, self.nope_dim + self.v_dim)
        k = torch.cat([kv[..., :self.nope_dim], k_pe.expand(n, h, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        pad = self.expanded_dim - self.qk_dim  # zeros add nothing to the scores
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        v = F.pad(kv[..., self.nope_dim:], (0, self.expanded_dim - self.v_dim))
        o = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return o[..., :self.v_dim]
