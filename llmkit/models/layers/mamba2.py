"""The Mamba-2 mixer (a selective state-space layer), as Bamba, Granite-4 hybrids and Falcon-H1
use it: one input projection cut into the gate, the conv input (x, B, C) and dt; a causal
depthwise conv; the SSD scan; a gated grouped RMSNorm; the output projection.

Its per-request state (the conv's last ``d_conv - 1`` inputs and the SSM state) is what the
layer's ``RecurrentStateSpec`` declares: the runner hands it ``(conv_state [num_blocks,
conv_dim, d_conv - 1], ssm_state [num_blocks, n_heads, head_dim, d_state])`` and request r's
state is at block ``block_table[r, 0]`` of the layer's group.
"""
from __future__ import annotations

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.models.layers.context import ModelContext
from llmkit.models.layers.linear import Linear
from llmkit.ops.mamba import RecurrentBatch

def recurrent_batch(md: AttentionMetadata) -> RecurrentBatch:
    """The step's requests as a recurrent layer sees them, from its group's metadata: request
    r's state block is ``block_table[r, 0]``; it starts from zeros when none of its tokens were
    computed before this step (context length == this step's tokens)."""
    qsl = md.query_start_loc_cpu[:md.num_reqs + 1]
    has_state = [md.seq_lens_cpu[r] > qsl[r + 1] - qsl[r] for r in range(md.num_reqs)]
    return RecurrentBatch(list(qsl), md.block_table[:md.num_reqs, 0], has_state)


def mamba2_dims(config, prefix: str = "mamba_") -> dict[str, int]:
    """The mixer's sizes from a Hugging Face config (Bamba's ``mamba_*`` names)."""
    n_heads = getattr(config, f"{prefix}n_heads")
    inter = int(getattr(config, f"{prefix}expand") * config.hidden_size)
    head_dim = getattr(config, f"{prefix}d_head")
    if head_dim in (None, "auto"):
        head_dim = inter // n_heads
    groups, d_state = getattr(config, f"{prefix}n_groups"), getattr(config, f"{prefix}d_state")
    return dict(n_heads=n_heads, head_dim=head_dim, intermediate=inter, n_groups=groups,
                d_state=d_state, d_conv=getattr(config, f"{prefix}d_conv"),
                conv_dim=inter + 2 * groups * d_state)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _Conv1dWeights(nn.Module):
    """Holds the depthwise conv's checkpoint tensors under their names (``conv1d.weight
    [conv_dim, 1, d_conv]``, ``conv1d.bias``); the conv itself is the platform's op."""

    def __init__(self, channels: int, width: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(channels, 1, width, dtype=dtype)
        self.bias = _param(channels, dtype=dtype) if bias else None


class Mamba2Mixer(nn.Module):
    """``x [T, hidden]`` -> ``[T, hidden]`` over every request's tokens, continuing each one's
    state."""

    def __init__(self, config, prefix: str, ctx: ModelContext) -> None:
        super().__init__()
        if ctx.tp.size > 1:
            raise ValueError("parallel.tensor_parallel_size > 1 is not supported by the Mamba-2 "
                             f"mixer (got {ctx.tp.size}; allowed: 1)")
        d = mamba2_dims(config)
        self.ops, self.dtype = ctx.ops, ctx.dtype
        self.n_heads, self.head_dim = d["n_heads"], d["head_dim"]
        self.n_groups, self.d_state = d["n_groups"], d["d_state"]
        self.intermediate, self.conv_dim = d["intermediate"], d["conv_dim"]
        self.chunk_size = config.mamba_chunk_size
        self.dt_limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        self.eps = config.rms_norm_eps
        self.activation = config.hidden_act
        bias = bool(config.mamba_proj_bias)
        self.in_proj = Linear.build(f"{prefix}.in_proj", config.hidden_size,
                                    self.intermediate + self.conv_dim + self.n_heads, bias=bias,
                                    dtype=ctx.dtype, linear_method=ctx.linear_method)
        self.conv1d = _Conv1dWeights(self.conv_dim, d["d_conv"], bool(config.mamba_conv_bias),
                                     ctx.dtype)
        self.dt_bias = _param(self.n_heads, dtype=ctx.dtype)
        self.A_log = _param(self.n_heads, dtype=ctx.dtype)
        self.D = _param(self.n_heads, dtype=ctx.dtype)
        self.norm = nn.Module()  # the gated RMSNorm's weight, under the checkpoint's name
        self.norm.weight = _param(self.intermediate, dtype=ctx.dtype)
        self.out_proj = Linear.build(f"{prefix}.out_proj", self.intermediate, config.hidden_size,
                                     bias=bias, dtype=ctx.dtype, linear_method=ctx.linear_method)

    def gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``rmsnorm(y * silu(gate))`` per group of ``intermediate / n_groups`` channels, in
        float32 (transformers' ``BambaRMSNormGated``, gate applied before the norm)."""
        h = y.float() * nn.functional.silu(gate.float())
        h = h.view(h.shape[0], self.n_groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight * h.view(h.shape[0], -1).to(self.dtype)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                batch: RecurrentBatch) -> torch.Tensor:
        conv_state, ssm_state = state
        t = x.shape[0]
        gate, xbc, dt = self.in_proj(x).split(
            [self.intermediate, self.conv_dim, self.n_heads], dim=-1)
        xbc = self.ops.causal_conv1d(xbc, self.conv1d.weight.view(self.conv_dim, -1),
                                     self.conv1d.bias, conv_state, batch, self.activation)
        xs, B, C = xbc.split([self.intermediate, self.n_groups * self.d_state,
                              self.n_groups * self.d_state], dim=-1)
        y = self.ops.ssd_scan(
            xs.reshape(t, self.n_heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
            B.reshape(t, self.n_groups, self.d_state), C.reshape(t, self.n_groups, self.d_state),
            self.D, self.dt_bias, ssm_state, batch, self.chunk_size, self.dt_limit)
        return self.out_proj(self.gated_norm(y.view(t, self.intermediate), gate))
