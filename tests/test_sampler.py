import torch

from llmkit.sampling import SamplingMetadata, TorchSampler


def meta(b, temperature=0.0, **kw):
    return SamplingMetadata(temperature=torch.full((b,), temperature),
                            all_greedy=temperature == 0.0, **kw)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(TorchSampler()(logits, meta(4)), logits.argmax(-1))


def test_token_mask_restricts_greedy_and_random():
    logits = torch.randn(3, 40) * 5
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[:, 10:13] = True
    s = TorchSampler(seed=1)
    assert set(s(logits, meta(3, token_mask=mask)).tolist()) <= {10, 11, 12}
    for _ in range(20):
        assert set(s(logits, meta(3, 1.0, token_mask=mask)).tolist()) <= {10, 11, 12}


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 30)
    out = TorchSampler()(logits, meta(5, 1.0, top_k=torch.ones(5, dtype=torch.long)))
    assert torch.equal(out, logits.argmax(-1))


def test_seeded_row_ignores_batch():
    logits = torch.zeros(4, 100)
    s = TorchSampler()
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    alone = [s(logits[:1], meta(1, 1.0, generators={0: gen}))
             for gen in [g()] for _ in range(5)]
    gen = g()
    mixed = [s(logits, meta(4, 1.0, generators={2: gen}))[2] for _ in range(5)]
    assert [int(a) for a in alone] == [int(m) for m in mixed]
