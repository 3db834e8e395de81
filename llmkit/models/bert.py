"""BERT-style encoders (Hugging Face ``BertModel``) for pooling engines: absolute position and
token-type embeddings, post-norm layers, bidirectional attention over each prompt.

An encoder keeps no KV cache: each layer attends within every prompt of the step (all its
tokens at once, no causal mask) and nothing is written to the pool, so a prompt must be
computed in one step, never in chunks (the front end refuses one longer than
``scheduler.max_num_batched_tokens``; the engine schedules these models without chunked prefill
or prefix caching). The pool the engine still sizes is a token count for the scheduler's
admission: the model declares the smallest one (one layer, one head).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from llmkit.attention.base import AttentionMetadata
from llmkit.models.base import CausalLM, ModelContext

__all__ = ["BertModel"]

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Layer(nn.Module):
    """One post-norm encoder layer, its parameters named as the checkpoint's."""

    def __init__(self, cfg, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.num_heads = cfg.num_attention_heads
        self.eps = cfg.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(h, h, dtype=dtype))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(h, h, dtype=dtype)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=self.eps, dtype=dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(h, inter, dtype=dtype)
        self.output = nn.Module()
        self.output.dense = nn.Linear(inter, h, dtype=dtype)
        self.output.LayerNorm = nn.LayerNorm(h, eps=self.eps, dtype=dtype)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        a = self.attention.self
        n, h = x.shape
        d = h // self.num_heads
        q, k, v = (lin(x).view(n, self.num_heads, d).transpose(0, 1)
                   for lin in (a.query, a.key, a.value))
        ctx = torch.empty_like(q)
        for s, e in zip(starts[:-1], starts[1:]):  # each prompt attends within itself
            ctx[:, s:e] = F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
        ctx = ctx.transpose(0, 1).reshape(n, h)
        o = self.attention.output
        x = o.LayerNorm(o.dense(ctx) + x)
        return self.output.LayerNorm(self.output.dense(self.act(self.intermediate.dense(x)))
                                     + x)


class BertModel(CausalLM):
    """Registered for ``BertModel``; pooled only (``model.runner`` is pooling)."""

    #: each prompt's tokens attend to each other: computed in one step, no KV kept
    is_bidirectional = True

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        cfg = hf_config
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT position_embedding_type {cfg.position_embedding_type!r} is "
                             "not supported (only absolute)")
        if ctx.tp.size > 1 or ctx.pp.size > 1:
            raise ValueError("BERT encoders run on one rank (parallel sizes 1)")
        h, dtype = cfg.hidden_size, ctx.dtype
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.embeddings.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h,
                                                           dtype=dtype)
        self.embeddings.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h, dtype=dtype)
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps, dtype=dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(cfg, dtype)
                                           for _ in range(cfg.num_hidden_layers))
        # The smallest pool the engine can size (see the module docstring): never written.
        self.num_layers, self.num_kv_heads = 1, 1
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.hidden_size = h
        self.vocab_size = cfg.vocab_size

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's hidden states (BERT has no final norm after it)."""
        e = self.embeddings
        x = inputs_embeds if inputs_embeds is not None else e.word_embeddings(input_ids)
        # one token type (0): a pooling request is one text
        x = e.LayerNorm(x + e.position_embeddings(positions) + e.token_type_embeddings.weight[0])
        starts = list(attn_metadata.query_start_loc_cpu)
        for layer in self.encoder.layer:
            x = layer(x, starts)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError("a BERT encoder computes embeddings only (model.runner=pooling)")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue  # the next-sentence head and the tanh pooler: not the embedding
            # old checkpoints name LayerNorm parameters gamma/beta
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias")
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no counterpart in the model")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model's is {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
