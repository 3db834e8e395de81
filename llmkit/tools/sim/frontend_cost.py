"""What a serving front end on the engine's own CPU cores costs its steps, fitted from a served
run's step trace.

``llmkit sim calibrate engine`` times the engine alone. Served, a CPU engine shares its cores with
the API server (detokenisation, one SSE chunk per token, HTTP) and, when benchmarked on the same
machine, with the client parsing those chunks: its steps take longer, by the CPU those take,
which grows with the tokens streamed per second. On this project's 2-core machine a served run at
~76 tokens/s had steps ~12–20% longer than the engine-alone model of the same steps, prefill and
decode alike; steps at ~28 tokens/s far less.

The model: the front end spends ``c`` seconds of the engine's CPU per token it streams
(``frontend_token_us``). At a streaming rate ``R`` (tokens/s, ``StreamRate``: the tokens of the
last second or so, a count decayed with a 1 s time constant, because the front end's queues
smooth it over about that long) it holds a share ``c·R`` of the CPU, and a step the engine alone
takes ``t`` then takes ``t / (1 − c·R)``.

Fit (``frontend_cost_from_trace``): each step of the trace (``llmkit serve
observability.trace_file=PATH`` under load) is priced by the profile just fitted to the engine
alone, from the counts the trace holds; ``R`` is replayed from its timestamps. From
``measured·(1 − c·R) = modelled``: ``measured − modelled = c · R · measured``, a least-squares
fit through the origin.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmkit.config.errors import ConfigError
from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.model_shape import ModelShape
from llmkit.cost_model.step_cost import CostModel, SeqWork

__all__ = ["FrontendFit", "StreamRate", "frontend_cost_from_trace", "step_work", "trace_steps"]


class StreamRate:
    """Tokens per second streamed lately: a token count decayed with time constant ``tau_s``."""

    __slots__ = ("tau_s", "_count", "_t")

    def __init__(self, tau_s: float = 1.0) -> None:
        self.tau_s = tau_s
        self._count = 0.0
        self._t: float | None = None

    def at(self, t: float) -> float:
        if self._t is None:
            return 0.0
        return self._count * math.exp(-max(0.0, t - self._t) / self.tau_s) / self.tau_s

    def add(self, t: float, tokens: int) -> None:
        """``tokens`` streamed at time ``t`` (not before the last call's)."""
        self._count = self.at(t) * self.tau_s + tokens
        self._t = t


@dataclass(slots=True, frozen=True)
class FrontendFit:
    token_s: float  # c: engine CPU seconds per token streamed
    num_steps: int
    mean_rate: float  # tokens/s streamed, over the trace's steps
    excess: float  # Σ(measured − modelled) / Σ modelled before the front end is added
    trace: str


def trace_steps(path: str | Path) -> list[dict[str, Any]]:
    """The step records (``StepRecord.to_dict()``) of a Chrome trace ``StepTrace`` wrote."""
    def bad(why: str) -> ConfigError:
        return ConfigError("sim.calibrate_trace", str(path), "",
                           message=f"{path}: {why}")

    try:
        doc = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise bad(f"cannot read a step trace ({e})") from None
    events = doc.get("traceEvents", ()) if isinstance(doc, dict) else ()
    steps = [ev["args"] for ev in events if isinstance(ev, dict)
             and ev.get("cat") == "step" and ev.get("ph") == "X" and "args" in ev]
    if not steps:
        raise bad("no engine steps in it (write one with `llmkit serve "
                  "observability.trace_file=PATH`)")
    if not any("decode_context" in s for s in steps):
        raise bad("its steps carry no context sizes (a trace from an older llmkit); record "
                  "it again")
    return sorted(steps, key=lambda s: s["start_s"])


def step_work(step: dict[str, Any]) -> list[SeqWork]:
    """The step's requests as the cost model takes them. The trace holds sums, so requests of
    one kind get equal shares (exact for decodes, whose cost is linear in their context)."""
    work: list[SeqWork] = []
    for reqs, tokens, context in ((step["decode_reqs"], step["decode_tokens"],
                                   step["decode_context"]),
                                  (step["prefill_reqs"], step["prefill_tokens"],
                                   step["prefill_context"])):
        if reqs <= 0 or tokens <= 0:
            continue
        q = max(1, round(tokens / reqs))
        c = max(q, round(context / reqs))
        work += [SeqWork(q, c, True)] * reqs
    return work


def frontend_cost_from_trace(path: str | Path, shape: ModelShape, profile: HardwareProfile,
                             dtype: str) -> FrontendFit:
    """``c`` as the module's docstring defines it, for the steps of the trace at ``path``
    priced by ``profile`` (whose own ``frontend_token_s`` is ignored)."""
    cm = CostModel(shape, replace(profile, frontend_token_s=0.0), dtype)
    stream = StreamRate()
    sxy = sxx = total_model = total_measured = rate_sum = 0.0
    n = 0
    for step in trace_steps(path):
        work = step_work(step)
        measured = float(step.get("step_ms", 0.0)) / 1e3
        if not work or measured <= 0:
            continue
        rate = stream.at(step["start_s"])
        modelled = cm.step(work).total_s
        x = rate * measured
        sxy += (measured - modelled) * x
        sxx += x * x
        total_model += modelled
        total_measured += measured
        rate_sum += rate
        n += 1
        stream.add(step["start_s"] + measured, len(work))  # streamed once the step ends
    if not n:
        raise ConfigError("sim.calibrate_trace", str(path), "",
                          message=f"{path}: no step in it computed any tokens")
    token_s = max(0.0, sxy / sxx) if sxx > 0 else 0.0
    return FrontendFit(token_s=token_s, num_steps=n, mean_rate=rate_sum / n,
                       excess=total_measured / total_model - 1.0, trace=str(path))
