"""Per-step engine stats, kept in memory and written as a Chrome-trace JSON (Perfetto).

``observability.trace_file=PATH`` makes ``EngineCore`` record every step: when it ran, how long
``schedule`` / ``execute`` / ``update`` took, how many requests it batched and how many tokens
it scheduled — split into **prefill** (requests whose step computes prompt tokens, or recomputes
after a preemption) and **decode** (requests past their prompt, computing new tokens; with
speculative decoding also the draft tokens they verify, and how many of those were accepted).
The file is written when the engine shuts down (and at interpreter exit); open it at
https://ui.perfetto.dev or chrome://tracing: one track of step slices (each with its numbers as
args) and counter tracks for tokens, batch size, queue length and KV usage.

A ``StepTrace`` is a step observer (``llmkit/engine/observe/observer.py``): ``EngineCore`` registers
one for ``observability.trace_file``; ``bench latency`` registers one without a file to time
each step.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmkit.config.schema import ObservabilityConfig
from llmkit.engine.observe.observer import StepEvent, split_prefill_decode

# split_prefill_decode lived here before the observer API; it is re-exported for its callers.
__all__ = ["StepRecord", "StepTrace", "split_prefill_decode"]


@dataclass(slots=True)
class StepRecord:
    step: int
    start_s: float  # time.perf_counter() at the step's start
    schedule_ms: float
    execute_ms: float
    update_ms: float
    num_reqs: int  # the batch size: requests with tokens scheduled in this step
    scheduled_tokens: int
    prefill_reqs: int
    prefill_tokens: int
    decode_reqs: int
    decode_tokens: int
    num_preempted: int
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float
    # Σ context after the step (tokens cached + computed) over the prefill / decode requests:
    # with the counts above, enough for `llmkit sim calibrate` to price the step.
    prefill_context: int = 0
    decode_context: int = 0
    # speculative decoding, in this step: requests that verified drafts, the draft tokens they
    # verified (part of decode_tokens) and how many were accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def step_ms(self) -> float:
        return self.schedule_ms + self.execute_ms + self.update_ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_ms"] = self.step_ms
        return d


class StepTrace:
    """Records steps (at most ``max_steps``, the first ones); ``write()`` saves the trace."""

    def __init__(self, path: str | os.PathLike | None = None, *,
                 max_steps: int = 100_000) -> None:
        self.path = Path(path).expanduser() if path else None
        self.max_steps = max_steps
        self.steps: list[StepRecord] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._written = False
        if self.path is not None:
            atexit.register(self.close)

    @classmethod
    def from_config(cls, observability: ObservabilityConfig) -> "StepTrace | None":
        """A trace for ``observability.trace_file``, or ``None`` when it is unset."""
        path = observability.trace_file
        if not path:
            return None
        return cls(path, max_steps=observability.trace_max_steps)

    # -- the step observer ------------------------------------------------------------------
    def on_step(self, event: StepEvent) -> None:
        if len(self.steps) >= self.max_steps:
            self.dropped += 1
            return
        stats, split = event.stats, event.split
        spec = stats.step_spec_decode
        with self._lock:
            self.steps.append(StepRecord(
                step=len(self.steps) + self.dropped, start_s=event.start_s,
                schedule_ms=1e3 * event.schedule_s, execute_ms=1e3 * event.execute_s,
                update_ms=1e3 * event.update_s, num_reqs=event.num_reqs,
                scheduled_tokens=event.num_scheduled_tokens,
                prefill_reqs=split.prefill_reqs, prefill_tokens=split.prefill_tokens,
                decode_reqs=split.decode_reqs, decode_tokens=split.decode_tokens,
                num_preempted=event.num_preempted, num_running=stats.num_running,
                num_waiting=stats.num_waiting, kv_usage=float(stats.kv_usage),
                prefill_context=split.prefill_context, decode_context=split.decode_context,
                spec_drafts=spec.num_drafts, spec_draft_tokens=spec.num_draft_tokens,
                spec_accepted_tokens=spec.num_accepted_tokens))

    def clear(self) -> None:
        with self._lock:
            self.steps.clear()
            self.dropped = 0

    # -- output ----------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """The Trace Event Format: complete events ("X") for steps and their phases, counter
        events ("C") for the numbers; timestamps in µs from the first step."""
        with self._lock:
            steps = list(self.steps)
        pid, tid = os.getpid(), 1
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "llmkit engine"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
             "args": {"name": "EngineCore.step"}},
        ]
        origin = steps[0].start_s if steps else 0.0
        for s in steps:
            ts = 1e6 * (s.start_s - origin)
            kind = ("mixed" if s.prefill_tokens and s.decode_tokens
                    else "prefill" if s.prefill_tokens else "decode" if s.decode_tokens
                    else "idle")
            args = s.to_dict()
            events.append({"ph": "X", "name": f"step {s.step} ({kind})", "cat": "step",
                           "pid": pid, "tid": tid, "ts": ts, "dur": 1e3 * s.step_ms,
                           "args": args})
            t = ts
            for name, ms in (("schedule", s.schedule_ms), ("execute", s.execute_ms),
                             ("update", s.update_ms)):
                events.append({"ph": "X", "name": name, "cat": "phase", "pid": pid,
                               "tid": tid, "ts": t, "dur": 1e3 * ms})
                t += 1e3 * ms
            events.append({"ph": "C", "name": "scheduled tokens", "pid": pid, "ts": ts,
                           "args": {"prefill": s.prefill_tokens, "decode": s.decode_tokens}})
            events.append({"ph": "C", "name": "batch size", "pid": pid, "ts": ts,
                           "args": {"prefill reqs": s.prefill_reqs,
                                    "decode reqs": s.decode_reqs}})
            events.append({"ph": "C", "name": "queue", "pid": pid, "ts": ts,
                           "args": {"running": s.num_running, "waiting": s.num_waiting}})
            events.append({"ph": "C", "name": "kv usage", "pid": pid, "ts": ts,
                           "args": {"usage": s.kv_usage}})
            if s.spec_drafts:
                events.append({"ph": "C", "name": "speculative", "pid": pid, "ts": ts,
                               "args": {"draft tokens": s.spec_draft_tokens,
                                        "accepted": s.spec_accepted_tokens}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"generator": "llmkit", "steps": len(steps),
                              "dropped_steps": self.dropped}}

    def write(self, path: str | os.PathLike | None = None) -> Path:
        target = Path(path).expanduser() if path else self.path
        if target is None:
            raise ValueError("no trace file: pass a path or set observability.trace_file")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.chrome_trace()))
        tmp.replace(target)
        return target

    def close(self) -> None:
        """Write the trace to its file once (at engine shutdown or interpreter exit)."""
        if self.path is None or self._written:
            return
        self._written = True
        try:
            self.write()
        finally:
            atexit.unregister(self.close)
