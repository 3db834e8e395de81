"""How many draft tokens a step may propose per row: adaptive K and ``disable_by_batch_size``.

Verifying K drafts makes a decoding row compute 1 + K tokens. While the step's forward is
memory-bound (weights streamed once, whatever the token count), those tokens are nearly free;
past the machine's *ridge point* (the token count where the forward turns compute-bound) each
extra token costs its full share, and drafts that are rejected make the step slower than no
speculation. So with ``adaptive``, K for the next step is the largest k <= K with
``rows x (1 + k) <= ridge_tokens``, 0 when even one draft per row passes it. The ridge comes
from the platform (``Platform.measure_ridge_tokens``: a short timing of the model's forward at a
few token counts at start-up) or from ``speculative.ridge_tokens`` (a calibrated value).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class DraftLengthPolicy:
    adaptive: bool = False
    ridge_tokens: int | None = None  # needed when adaptive
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.adaptive and (self.ridge_tokens is None or self.ridge_tokens < 1):
            raise ValueError(f"adaptive K needs ridge_tokens >= 1, got {self.ridge_tokens}")

    def num_drafts(self, k: int, num_rows: int, num_running: int) -> int:
        """K for a step with ``num_rows`` rows to draft among ``num_running`` requests."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or num_rows <= 0:
            return k
        return max(0, min(k, self.ridge_tokens // num_rows - 1))
