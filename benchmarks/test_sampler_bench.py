"""The torch sampler on one step's logits: 64 rows × a 32k vocabulary (CPU; 256 × 128k on a
GPU), one group per parameter mix so the cost of each feature reads as a ratio to greedy.

Run: ``pytest benchmarks/test_sampler_bench.py --benchmark-only``.
"""
from __future__ import annotations

import pytest
import torch

from llmkit.sampling.sampler import PenaltyInputs, SamplingMetadata
from llmkit.sampling.sampler import TorchSampler

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROWS, VOCAB = (256, 128_256) if CUDA else (64, 32_000)


def metadata(kind: str) -> SamplingMetadata:
    def full(value, dtype=torch.float32):
        return torch.full((ROWS,), value, dtype=dtype, device=DEVICE)

    if kind == "greedy":
        return SamplingMetadata(temperature=full(0.0), all_greedy=True)
    meta = SamplingMetadata(temperature=full(0.8), all_greedy=False)
    if kind == "top_k_top_p":
        meta.top_k = full(50, torch.int64)
        meta.top_p = full(0.9)
    elif kind == "min_p":
        meta.min_p = full(0.05)
    elif kind == "penalties":
        g = torch.Generator().manual_seed(0)
        counts = torch.randint(0, 3, (ROWS, VOCAB), generator=g, dtype=torch.int32)
        meta.penalties = PenaltyInputs.from_dense(
            rows=torch.arange(ROWS, device=DEVICE), presence=full(0.5), frequency=full(0.2),
            repetition=full(1.1), output_counts=counts.to(DEVICE),
            prompt_mask=(counts > 1).to(DEVICE))
    elif kind == "logprobs":
        meta.max_num_logprobs = 5
    return meta


KINDS = ["greedy", "random", "top_k_top_p", "min_p", "penalties", "logprobs"]


@pytest.mark.benchmark(group="sampler")
@pytest.mark.parametrize("kind", KINDS)
def test_sampler(benchmark, kind):
    sampler = TorchSampler(seed=0)
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    meta = metadata(kind)

    def run():
        out = sampler.sample(logits.clone(), meta)
        if CUDA:
            torch.cuda.synchronize()
        return out

    out = benchmark(run)
    assert out is not None
    benchmark.extra_info.update(rows=ROWS, vocab=VOCAB)
