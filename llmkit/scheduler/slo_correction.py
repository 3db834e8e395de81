"""The SLO scheduler's online correction of the cost model: measured over predicted step time.

A hardware profile describes the engine alone, as ``llmkit sim calibrate engine`` timed it.
Served, a step takes longer (an API server and the clients share the cores, the engine core
process sends each step's output) or shorter (a profile from a slower build). The engine core
measures every step on its clock (``Scheduler.update_from_output(..., step_s=)``: from the
previous step's output to this one's while it steps without pause, i.e. the time between two
tokens of a decoding request); the scheduler priced the same step with the cost model when it
scheduled it. ``StepCorrection`` keeps, per kind of step — decode-only, or with prefill tokens
(mixed: its time is mostly the prefill's per-token cost, a decode step's mostly the per-step
one) — an exponential moving average of each, and scales later predictions of that kind by
their ratio::

    M_k ← M_k + w (measured − M_k)       P_k ← P_k + w (predicted − P_k)      (first step: =)
    factor_k = M_k / P_k                 (a kind not seen yet: the other kind's, else 1)

``w`` is ``scheduler.slo_correction_weight`` (0 = off: the profile alone). A ratio of averages,
not an average of ratios, so that long steps weigh more than short ones. One step's ratio is
clipped to ``[1/4, 4]`` times the current factor first: a step that stalled once (a collection,
a graph compiled in the background) moves the factor by at most that, while a profile off by 2x
is learned from the first step.
"""
from __future__ import annotations

__all__ = ["StepCorrection"]

# one step's measured/predicted ratio is clipped to within this factor of the current estimate
_MAX_JUMP = 4.0

DECODE, MIXED = 0, 1


class StepCorrection:
    __slots__ = ("weight", "_measured", "_predicted", "steps")

    def __init__(self, weight: float) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"the correction's weight must be in [0, 1], got {weight}")
        self.weight = weight
        self._measured = [0.0, 0.0]
        self._predicted = [0.0, 0.0]
        self.steps = [0, 0]  # steps observed per kind (decode-only, mixed)

    def factor(self, mixed: bool) -> float:
        """What predictions of a step of this kind are multiplied by."""
        k = MIXED if mixed else DECODE
        if not self.steps[k]:
            k = 1 - k
            if not self.steps[k]:
                return 1.0
        return self._measured[k] / self._predicted[k]

    def observe(self, mixed: bool, predicted_s: float, measured_s: float) -> None:
        """A step of this kind that the profile priced at ``predicted_s`` took ``measured_s``."""
        if self.weight <= 0.0 or predicted_s <= 0.0 or measured_s <= 0.0:
            return
        now = self.factor(mixed)
        ratio = min(max(measured_s / predicted_s, now / _MAX_JUMP), now * _MAX_JUMP)
        measured = ratio * predicted_s
        k = MIXED if mixed else DECODE
        if self.steps[k]:
            w = self.weight
            self._measured[k] += w * (measured - self._measured[k])
            self._predicted[k] += w * (predicted_s - self._predicted[k])
        else:
            self._measured[k], self._predicted[k] = measured, predicted_s
        self.steps[k] += 1

    def describe(self) -> dict[str, float]:
        return {"decode": self.factor(False), "mixed": self.factor(True)}
