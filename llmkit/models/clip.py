"""The CLIP vision tower (ViT) that LLaVA-style models encode images with.

Plain torch modules named as Hugging Face's ``CLIPVisionModel`` so checkpoint names map one to
one. Only the layers up to the one whose output the language model reads
(``vision_feature_layer``) are built: later layers and ``post_layernorm`` never affect it.
The encoder runs once per image, outside the paged-KV path (no cache: bidirectional attention
over one image's patches).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def vision_activation(name: str):
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported; supported: "
                         f"{', '.join(VISION_ACTIVATIONS)}")
    return VISION_ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        dim = config.hidden_size
        self.patch_size = config.patch_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.class_embedding = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, config.patch_size,
                                         stride=config.patch_size, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding(self.num_patches + 1, dim, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim, dtype=dtype)
        self.k_proj = nn.Linear(dim, dim, dtype=dtype)
        self.v_proj = nn.Linear(dim, dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = vision_activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.self_attn = CLIPAttention(config, dtype)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, dtype) for _ in range(num_layers))


def num_layers_to_feature(config, feature_layer: int) -> int:
    """How many encoder layers produce HF's ``hidden_states[feature_layer]`` (index 0 is the
    embeddings, after ``pre_layrnorm``)."""
    total = config.num_hidden_layers
    n = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 0 <= n <= total:
        raise ValueError(f"vision_feature_layer {feature_layer} is out of range for a vision "
                         f"tower of {total} layers")
    return n


class CLIPVisionModel(nn.Module):
    """``pixel_values [images, channels, H, W]`` -> the hidden states after
    ``num_layers`` encoder layers, ``[images, 1 + patches, hidden]`` (CLS first)."""

    def __init__(self, config, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                         dtype=dtype)
        self.encoder = CLIPEncoder(config, num_layers, dtype)
        self.num_patches = self.embeddings.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x
