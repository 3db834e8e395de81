"""The sampler's exact distributions: one fixed logits vector, the filter cases, the filtered
distribution computed from the definitions in float64, and the chi-square check of draws
against it (``tests/test_sampling_distribution.py`` says why the method is sound; the CUDA
sampler's test uses the same)."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

LOGITS = np.array([2.2, 0.4, 1.9, -0.3, 1.3, 0.9, -1.0, 1.6, 0.1, -2.0, 0.6, -0.7])
N = 20_000
ALPHA = 0.01

# (temperature, top_k, top_p, min_p): each alone, and combinations.
CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.5, 0, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 6, 0.9, 0.0),
    (1.3, 0, 0.7, 0.05),
    (1.2, 5, 0.6, 0.02),
    (0.5, 8, 1.0, 0.03),
]
# Every chi-square check of tests/test_sampling_distribution.py: the cases, the same cases
# through the top-p candidate path, and the three mutants.
PER_CASE_ALPHA = ALPHA / (len(CASES) + sum(c[2] < 1.0 for c in CASES) + 3)


def expected_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                          min_p: float) -> np.ndarray:
    """The filtered distribution, from the definitions, in float64."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        mass_before = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass_before >= top_p:
                keep[i] = False
            mass_before += q[i]
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def fits(counts: np.ndarray, expected: np.ndarray) -> tuple[bool, str]:
    support = expected > 0
    outside = int(counts[~support].sum())
    if outside:
        return False, f"{outside} draws outside the support"
    stat, p_value = chisquare(counts[support], expected[support] * counts.sum())
    return p_value >= PER_CASE_ALPHA, f"chi2={stat:.1f} p={p_value:.2e}"
