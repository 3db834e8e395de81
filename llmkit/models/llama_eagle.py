"""The EAGLE draft head for the Llama family (EAGLE-1; Li et al., 2024).

At position p the head reads the target's final hidden state ``f_p`` and the embedding of the
next token ``t_{p+1}``: ``x = fc([embed(t_{p+1}); f_p])``, then its decoder layer(s) (the first
without its input norm, as trained), and the sum of the last layer's output and residual is the
predicted feature ``f_{p+1}``; the *target's* LM head turns it into the distribution of
``t_{p+2}``. The embedding is the target's too.

The checkpoint is an EAGLE folder: ``config.json`` (a Llama config, usually one layer) and
``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight`` (``[hidden, 2 hidden]``,
optional ``fc.bias``) and ``layers.N.*`` named as in Hugging Face's Llama; an
``embed_tokens.weight`` or ``lm_head.weight`` it carries is the target's and is not loaded.
The decoder layer is llmkit's Llama layer, built with the target's ``ModelContext``.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.linear.base import copy_weight
from llmkit.models.base import ModelContext
from llmkit.models.layers.linear import Linear
from llmkit.models.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from llmkit.models.llama import (IGNORED_WEIGHTS, LlamaDecoderLayer, _head_dim,
                                 expected_linear_weights, load_linear_weight, raise_if_missing)

# Checkpoint tensors that are the target's (shared, never loaded from the head).
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


class EagleLlamaHead(nn.Module):
    def __init__(self, config, ctx: ModelContext, *, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = Linear.build("fc", 2 * h, h, bias=fc_bias, dtype=ctx.dtype,
                               linear_method=ctx.linear_method)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, f"layers.{i}", ctx)
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        head_dim = _head_dim(config)
        inv_freq, scaling = compute_inv_freq(config, head_dim)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, inv_freq,
                                          scaling, ctx.dtype,
                                          rope_parameters(config).get("mrope_section"))
        attn = self.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, head_dim
        self.hidden_size = h

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``input_embeds``: the target's embeddings of the tokens after each position;
        ``hidden_states``: the features at the positions. Returns the predicted features."""
        x = self.fc(torch.cat((input_embeds, hidden_states.to(input_embeds.dtype)), dim=-1))
        rope = self.rotary_emb.lookup(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata)
        return x + residual

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        params = {name: p for name, p in self.named_parameters()
                  if name.rpartition(".")[0] not in linears}
        expected = expected_linear_weights(linears) | {(name, None) for name in params}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.endswith(IGNORED_WEIGHTS) or name in SHARED_WITH_TARGET:
                continue
            key = load_linear_weight(linears, name, tensor)
            if key is not None:
                loaded.add(key)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE checkpoint weight {name!r} has no counterpart in the "
                                 "head (EAGLE-1 Llama heads: fc, layers.N.*)")
            copy_weight(param, tensor, name)
            loaded.add((name, None))
        raise_if_missing(expected, loaded, checkpoint="EAGLE checkpoint", owner="head")
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
