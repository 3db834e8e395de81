"""The vision transformer of Qwen2-VL and Qwen2.5-VL: patches of any image size in, one
embedding per 2x2 block of patches (a language-model token) out.

One class reads the variant from the vision config. Both embed ``temporal x patch x patch``
pixel cubes with a 3-D convolution, rotate queries and keys by the patch's (row, column) in
the image (2-D rotary), and merge each ``spatial_merge_size``² block of patches into one
token with an MLP. Qwen2.5-VL adds window attention (most blocks attend within windows of
``window_size`` pixels; ``fullatt_block_indexes`` attend over the whole image), RMSNorm and a
gated MLP. Module names follow Hugging Face's so checkpoint names map one to one.

A batch is several images of one patch grid (the runner groups them): ``[images, patches,
channels * temporal * patch²]``, patches in the image processor's order (merge blocks
contiguous). Attention runs per segment (a frame, or a window) without masks: segments of equal
length are batched into one call, so each is computed exactly as alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.models.clip import vision_activation
from llmkit.models.layers.norm import RMSNorm
from llmkit.ops.base import ModelOps

#: (segment starts [segments, 1] + arange(length)) index tensors, one per distinct length.
Segments = list[torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_position_ids(grid_thw: tuple[int, int, int], merge: int) -> torch.Tensor:
    """``[t*h*w, 2]`` (row, column) of each patch, in merge-block order, repeated per frame."""
    t, h, w = grid_thw
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(1, 2).flatten()
    cols = cols.reshape(block).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_index(grid_thw: tuple[int, int, int], merge: int, window_tokens: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order: ``(order of the merged tokens, window lengths in
    patches)``. Windows are ``window_tokens``² merged tokens; those at the right and bottom
    edges are smaller."""
    t, h, w = grid_thw
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h, pad_w = -gh % window_tokens, -gw % window_tokens
    nh, nw = (gh + pad_h) // window_tokens, (gw + pad_w) // window_tokens
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -1)
    padded = padded.reshape(t, nh, window_tokens, nw, window_tokens).permute(0, 1, 3, 2, 4)
    padded = padded.reshape(t * nh * nw, window_tokens * window_tokens)
    keep = padded >= 0
    lengths = [n * merge * merge for n in keep.sum(-1).tolist() if n]
    return padded[keep], lengths


def segments_of(lengths: list[int]) -> Segments:
    """Index tensors that gather contiguous segments of ``lengths``, grouped by length."""
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    by_length: dict[int, list[int]] = {}
    for s, n in zip(starts.tolist(), lengths):
        by_length.setdefault(n, []).append(s)
    return [torch.tensor(s)[:, None] + torch.arange(n) for n, s in by_length.items()]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      segments: Segments | None) -> torch.Tensor:
    """Bidirectional attention within segments: ``q, k, v [images, heads, patches, d]``;
    ``segments`` None: one segment of all patches."""
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v)
    out = torch.empty_like(q)
    b, h, _, d = q.shape
    for idx in segments:
        w, n = idx.shape
        flat = idx.flatten().to(q.device)

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x[:, :, flat].view(b, h, w, n, d).transpose(1, 2).reshape(b * w, h, n, d)

        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v))
        out[:, :, flat] = o.view(b, w, h, n, d).transpose(1, 2).reshape(b, h, w * n, d)
    return out


class VisionPatchEmbed(nn.Module):
    def __init__(self, config, embed_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_channels = config.in_channels
        self.temporal_patch_size = config.temporal_patch_size
        self.patch_size = config.patch_size
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.embed_dim = embed_dim
        self.proj = nn.Conv3d(config.in_channels, embed_dim, kernel, stride=kernel, bias=False,
                              dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cube = x.reshape(-1, self.in_channels, self.temporal_patch_size, self.patch_size,
                         self.patch_size)
        return self.proj(cube.to(self.proj.weight.dtype)).view(*x.shape[:-1], self.embed_dim)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True, dtype=dtype)
        self.proj = nn.Linear(dim, dim, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        # Rotated in float32, as the reference does, whatever the model's dtype.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        o = segment_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              segments)
        return self.proj(o.transpose(1, 2).reshape(b, n, -1))


class VisionMlp(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL's ``down(act(gate(x)) * up(x))`` (with biases)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(kind: str, dim: int, dtype: torch.dtype, ops: ModelOps) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, 1e-6, dtype, ops)
    return nn.LayerNorm(dim, eps=1e-6, dtype=dtype)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: str, dtype: torch.dtype,
                 ops: ModelOps) -> None:
        super().__init__()
        self.norm1 = _norm(norm, dim, dtype, ops)
        self.norm2 = _norm(norm, dim, dtype, ops)
        self.attn = VisionAttention(dim, num_heads, dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each ``merge``² consecutive patches -> one language-model token."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: str, dtype: torch.dtype,
                 ops: ModelOps) -> None:
        super().__init__()
        self.hidden_size = dim * merge * merge
        self.ln_q = _norm(norm, dim, dtype, ops)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size, dtype=dtype),
                                 nn.GELU(),
                                 nn.Linear(self.hidden_size, out_dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return self.mlp(self.ln_q(x).reshape(b, -1, self.hidden_size))


class Qwen2VisionTransformer(nn.Module):
    """``[images, patches, C*T*P*P]`` of one grid ``(t, h, w)`` (in patches) ->
    ``[images, t*h*w / merge², out_hidden]``."""

    def __init__(self, config, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        windowed = config.model_type == "qwen2_5_vl_vision"
        self.merge = config.spatial_merge_size
        if windowed:
            dim, out_dim = config.hidden_size, config.out_hidden_size
            hidden, norm = config.intermediate_size, "rms"
            self.window_tokens = config.window_size // self.merge // config.patch_size
            self.full_blocks = set(config.fullatt_block_indexes)
        else:
            dim, out_dim = config.embed_dim, config.hidden_size
            hidden, norm = int(config.embed_dim * config.mlp_ratio), "layer"
            self.window_tokens, self.full_blocks = 0, set()
        mlp = VisionGatedMlp if windowed else VisionMlp
        self.patch_embed = VisionPatchEmbed(config, dim, dtype)
        head_dim = dim // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta",
                                                                           10000.0))
        # Half the head dim rotates by the row, half by the column.
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float) / spatial), persistent=False)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, config.num_heads, mlp(dim, hidden, config.hidden_act, dtype), norm,
                        dtype, ops) for _ in range(config.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, norm, dtype, ops)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid_thw
        x = self.patch_embed(pixel_values)
        b, n, dim = x.shape
        freqs = vision_position_ids(grid_thw, self.merge).to(x.device)[..., None].float() \
            * self.inv_freq
        freqs = freqs.reshape(n, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [patches, 1, head_dim]
        # Each frame attends within itself.
        full = None if t == 1 else segments_of([h * w] * t)
        windows, order = full, None
        unit = self.merge * self.merge
        if self.window_tokens:
            order, lengths = window_index(grid_thw, self.merge, self.window_tokens)
            order = order.to(x.device)
            windows = segments_of(lengths) if len(lengths) > 1 else None
            x = x.view(b, n // unit, unit, dim)[:, order].reshape(b, n, dim)
            cos = cos.view(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
            sin = sin.view(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if not self.window_tokens or i in self.full_blocks
                      else windows)
        x = self.merger(x)
        if order is not None:
            x = x[:, torch.argsort(order)]
        return x
