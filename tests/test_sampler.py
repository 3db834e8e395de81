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


def test_argmax_rows_is_torch_argmax_bit_for_bit():
    """The sampling path's argmax (numpy's on the CPU) answers torch's: first index of the
    maximum on ties, NaN counted as the maximum, infinities, 1-D, strided views, and the dtypes
    it hands back to torch."""
    from llmkit.sampling.argmax import argmax_rows

    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2], [nan, 1, nan, 0], [1, nan, 5, nan], [-inf, -inf, -inf, -inf],
            [inf, 1, inf, 0], [-0.0, 0.0, 0.0, -0.0], [5, inf, nan, inf]]
    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor(rows), torch.tensor(rows[1]),
             torch.randint(-3, 4, (6, 49152), generator=g).float(),
             torch.randn(5, 3000, generator=g)[:, ::3], torch.randn(4, 70, generator=g).half(),
             torch.randn(4, 70, generator=g).double(), torch.randn(4, 70, generator=g).bfloat16()]
    cases[2][1, 777] = nan
    for x in cases:
        got, want = argmax_rows(x), x.argmax(dim=-1)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), x
