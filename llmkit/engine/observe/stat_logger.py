"""The hooks through which ``AsyncLLM`` reports request latencies and the engine's step stats
(``llmkit.entrypoints.openai.metrics.ServerMetrics`` implements them)."""
from __future__ import annotations

from typing import Protocol

from llmkit.scheduler.base import SchedulerStats

__all__ = ["StatLogger"]


class StatLogger(Protocol):
    """What AsyncLLM reports (``llmkit.entrypoints.openai.metrics.ServerMetrics`` implements it)."""

    def on_scheduler_stats(self, stats: SchedulerStats) -> None: ...

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def on_new_tokens(self, num_tokens: int, inter_token_latency_s: float | None) -> None: ...

    def on_finished(self, finish_reason: str, e2e_s: float, queue_time_s: float | None,
                    num_prompt_tokens: int, num_generation_tokens: int) -> None: ...
