"""The batched sampler: one pass over a step's logits, per-row parameters.

Order of operations (fixed): external token mask → temperature → min-p → top-k → top-p →
sample. Greedy rows (temperature 0) take the argmax of the masked logits; random rows draw with
the exponential-race trick (argmax of p / Exp(1) noise is a categorical draw from p), which lets
a seeded row draw its noise from its own generator, so its tokens do not depend on the batch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters for the rows being sampled this step (float32/int64 CPU tensors)."""

    temperature: torch.Tensor  # [B]; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B]; 0 = off
    top_p: torch.Tensor | None = None  # [B]; 1 = off
    min_p: torch.Tensor | None = None  # [B]; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> own RNG
    # The structured-output seam: True = may be sampled. None = everything allowed.
    token_mask: torch.Tensor | None = None  # bool [B, V]


class Sampler(ABC):
    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Token ids ``[B]`` (int64) for float32 logits ``[B, V]``."""


class TorchSampler(Sampler):
    def __init__(self, seed: int = 0) -> None:
        # Rows without their own seed draw from this engine-wide generator.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.token_mask is not None:
            logits = logits.masked_fill(~metadata.token_mask, float("-inf"))
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_tokens
        temperature = metadata.temperature
        is_greedy = temperature < 1e-5
        scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        probs = self.filtered_probs(scaled, metadata)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in metadata.generators.items():
            noise[row].exponential_(generator=gen)
        random_tokens = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, random_tokens)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Softmax of temperature-scaled logits after min-p, top-k and top-p filtering."""
        if metadata.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = _top_k_top_p(logits, metadata.top_k, metadata.top_p)
        return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        beyond_k = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(beyond_k, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = mass_before >= top_p.unsqueeze(1)
        outside[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
