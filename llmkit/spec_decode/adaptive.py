"""How many draft tokens a step may propose per row: adaptive K and ``disable_by_batch_size``.

Verifying K drafts makes a decoding row compute 1 + K tokens. While the step's forward is
memory-bound (weights streamed once, whatever the token count), those tokens are nearly free;
past the machine's *ridge point* (the token count where the forward turns compute-bound) each
extra token costs its full share, and drafts that are rejected make the step slower than no
speculation. ``adaptive`` has two rules:

- **measured step costs** (the default when ``speculative.ridge_tokens`` is not given): the
  platform times a decode step of n rows at start-up (``Platform.measure_step_costs``), and the
  policy keeps a running estimate of how often draft j is accepted once the drafts before it
  were (``AcceptanceEstimate``, fed by the verified rows). K for the next step is the k <= K
  that maximises the expected tokens per second, ``(rows_undrafted + rows x E[tokens | k]) /
  t(running + rows x k)``. Past the ridge ``t`` grows with every token, so k falls to 0; below
  it the choice also weighs the acceptance: at batch 1 on a CPU, where each verified row costs
  a share of a one-row step, a copy workload's long accepted runs pay for K = 5 and a chatty one
  stops at 2 or 3.
- **the ridge rule** (``speculative.ridge_tokens`` given: a calibrated figure, and what ``llmkit
  sim`` uses): K is the largest k <= K with ``rows x (1 + k) <= ridge_tokens``, 0 when even one
  draft per row passes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class StepCosts:
    """Seconds of a decode step by its number of rows (tokens), from a few measured counts:
    linear between them, the last slope past the largest."""

    __slots__ = ("counts", "seconds")

    def __init__(self, timings: dict[int, float]) -> None:
        if not timings:
            raise ValueError("no step timings")
        self.counts = np.array(sorted(timings), dtype=np.float64)
        self.seconds = np.array([timings[n] for n in sorted(timings)], dtype=np.float64)

    def __call__(self, num_tokens: float) -> float:
        c, s = self.counts, self.seconds
        if len(c) == 1:
            return float(s[0] * max(1.0, num_tokens / c[0]))
        if num_tokens <= c[-1]:
            return float(np.interp(num_tokens, c, s))
        slope = max(0.0, (s[-1] - s[-2]) / (c[-1] - c[-2]))
        return float(s[-1] + slope * (num_tokens - c[-1]))


class AcceptanceEstimate:
    """P(draft j accepted | drafts before it accepted), j = 1..K, from the verified rows: counts
    that decay by ``decay`` per verified row (recent rows weigh most; acceptance moves with
    the text), started from ``prior`` worth ``prior_weight`` rows. A position no row tried
    lately (K was cut below it) takes the rate of the position before it."""

    __slots__ = ("tried", "accepted", "decay")

    def __init__(self, k: int, prior: float = 0.7, prior_weight: float = 2.0,
                 decay: float = 0.95) -> None:
        self.tried = np.full(k, prior_weight, dtype=np.float64)
        self.accepted = np.full(k, prior * prior_weight, dtype=np.float64)
        self.decay = decay

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One verify step's drafted rows: drafts each had, and how many were accepted."""
        d = np.asarray(num_drafts)[:, None]
        a = np.asarray(num_accepted)[:, None]
        pos = np.arange(1, len(self.tried) + 1)[None, :]
        tried = (pos <= d) & (pos <= a + 1)  # [rows, K]: position j was verified
        # the rows one after another: row i's counts decayed by the rows after it
        m = len(d)
        weights = self.decay ** np.arange(m - 1, -1, -1, dtype=np.float64)
        self.tried = self.tried * self.decay ** m + weights @ tried
        self.accepted = self.accepted * self.decay ** m + weights @ (tried & (pos <= a))

    def rates(self) -> np.ndarray:
        rates = np.empty(len(self.tried))
        last = 0.5
        for j, (t, a) in enumerate(zip(self.tried, self.accepted)):
            last = a / t if t >= 0.5 else last
            rates[j] = last
        return rates

    def expected_tokens(self) -> np.ndarray:
        """Tokens a drafted row yields with k = 0..K drafts (1 + the accepted ones)."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.rates()))])


@dataclass(slots=True)
class DraftLengthPolicy:
    adaptive: bool = False
    ridge_tokens: int | None = None  # the ridge rule's bound (with no step_costs)
    disable_by_batch_size: int | None = None
    step_costs: StepCosts | None = None  # measured: the expected-throughput rule
    acceptance: AcceptanceEstimate | None = field(default=None)

    def __post_init__(self) -> None:
        if self.adaptive and self.step_costs is None and (
                self.ridge_tokens is None or self.ridge_tokens < 1):
            raise ValueError(f"adaptive K needs ridge_tokens >= 1 or measured step costs, got "
                             f"{self.ridge_tokens}")

    def num_drafts(self, k: int, num_rows: int, num_running: int) -> int:
        """K for a step with ``num_rows`` rows to draft among ``num_running`` requests."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or num_rows <= 0:
            return k
        if self.step_costs is None:
            return max(0, min(k, self.ridge_tokens // num_rows - 1))
        if self.acceptance is None or len(self.acceptance.tried) < k:
            self.acceptance = AcceptanceEstimate(k)
        expected = self.acceptance.expected_tokens()[:k + 1]
        others = max(0, num_running - num_rows)
        best, best_rate = 0, 0.0
        for j in range(k + 1):
            rate = (others + num_rows * expected[j]) / self.step_costs(num_running + num_rows * j)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = j, rate
        return best

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """The verified rows of a step (the runner calls it after sampling)."""
        if self.step_costs is None or not len(num_drafts):
            return
        k = int(np.max(num_drafts))
        if self.acceptance is None or len(self.acceptance.tried) < k:
            old = self.acceptance
            self.acceptance = AcceptanceEstimate(k)
            if old is not None:
                n = len(old.tried)
                self.acceptance.tried[:n], self.acceptance.accepted[:n] = old.tried, old.accepted
        self.acceptance.observe(num_drafts, num_accepted)
