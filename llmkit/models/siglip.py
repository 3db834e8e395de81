"""The SigLIP vision tower of LLaVA-style models: CLIP's encoder layers (the same module
names: ``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``layer_norm2``, ``mlp.fc{1,2}``) over
patch embeddings with a bias and no CLS token, and no pre-encoder norm.

As with CLIP, only the layers up to ``vision_feature_layer`` are built; ``post_layernorm`` and
the pooling ``head`` never reach the language model.
"""
from __future__ import annotations

import torch
from torch import nn

from llmkit.models.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, config.patch_size,
                                         stride=config.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.num_patches, dim, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """``pixel_values [images, channels, H, W]`` -> the hidden states after ``num_layers``
    encoder layers, ``[images, patches, hidden]``."""

    def __init__(self, config, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config, dtype)
        self.encoder = CLIPEncoder(config, num_layers, dtype)
        self.num_patches = self.embeddings.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return x
