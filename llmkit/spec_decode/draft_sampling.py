"""How a draft model (or EAGLE head) picks its draft tokens from its own logits.

Greedy requests draft the argmax (their verification is accept-while-argmax, so any proposal
rule keeps their output). Sampled requests draw each draft from q = the draft's distribution
under the request's temperature, top-k, top-p and min-p (the closer q is to the target's p, the
more drafts survive); q is kept for the verification, which accepts with min(1, p / q). A
seeded request draws from its own generator, so its drafts do not depend on its batch.
"""
from __future__ import annotations

import numpy as np
import torch

from llmkit.sampling.argmax import argmax_rows
from llmkit.sampling.sampler import TorchSampler
from llmkit.sampling.params import is_random
from llmkit.spec_decode.base import ProposerBatch



def draw_drafts(logits: torch.Tensor, batch: ProposerBatch, rows: np.ndarray,
                generator: torch.Generator) -> tuple[np.ndarray, torch.Tensor | None, np.ndarray]:
    """``(tokens [R], q [S, V] or None, sampled [S])``: one draft per row of float32 ``logits
    [R, V]`` (row i belongs to batch row ``rows[i]``); ``q[j]`` is the distribution row
    ``sampled[j]`` (an index into ``rows``) drew from."""
    tokens = argmax_rows(logits)
    temperature = batch.temperature[rows]
    sampled = np.flatnonzero(is_random(temperature))
    if not len(sampled):
        return tokens.cpu().numpy(), None, sampled
    srows = rows[sampled]
    device = logits.device

    def column(values: np.ndarray, off) -> torch.Tensor | None:
        return None if bool((values == off).all()) else torch.from_numpy(values).to(device)

    idx = torch.from_numpy(sampled).to(device)
    scaled = logits[idx] / torch.from_numpy(temperature[sampled]).to(device).unsqueeze(1)
    q = TorchSampler.filtered_probs(scaled, column(batch.top_k[srows], 0),
                                    column(batch.top_p[srows], 1.0),
                                    column(batch.min_p[srows], 0.0))
    noise = torch.empty_like(q)
    noise.uniform_(generator=generator)
    for j, row in enumerate(srows.tolist()):
        gen = batch.generators[row]
        if gen is not None:
            noise[j].uniform_(generator=gen)
    tokens[idx] = argmax_rows(q / noise.log_().neg_())
    return tokens.cpu().numpy(), q, sampled
