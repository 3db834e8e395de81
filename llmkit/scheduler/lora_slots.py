"""Multi-LoRA: at most ``max_loras`` distinct adapters in one step.

A running request whose adapter finds no slot sits the step out. A waiting one is passed over
(later requests may go ahead, vLLM's rule) and put back in its place; once passed over
``max_lora_skips`` times, nothing behind it is admitted until it is, so it waits at most that
many steps plus the time the running requests of one resident adapter take to finish.
"""
from __future__ import annotations

from typing import Callable, Iterable

from llmkit.request import Request
from llmkit.scheduler.base import SchedulerStats
from llmkit.scheduler.hooks import ADMIT, PASS_OVER, PASS_OVER_AND_STOP, SchedulerFeature


class LoRASlots(SchedulerFeature):
    name = "lora"

    def __init__(self, max_loras: int, max_lora_skips: int,
                 queues: Callable[[], tuple[Iterable[Request], Iterable[Request]]]) -> None:
        self.max_loras = max_loras
        self.max_lora_skips = max_lora_skips
        self._queues = queues  # the scheduler's (running, waiting) requests, for the stats
        self._skips: dict[str, int] = {}
        self._step_loras: set[int] = set()  # the adapters of the step's requests so far

    def _fits(self, req: Request) -> bool:
        lora = req.lora_id
        return (lora is None or lora in self._step_loras
                or len(self._step_loras) < self.max_loras)

    def begin_step(self) -> None:
        self._step_loras = set()

    def limit_running(self, req: Request, n: int) -> int:
        # _fits inlined: this runs for every running request of every step
        lora = req.lora_id
        if lora is None or lora in self._step_loras or len(self._step_loras) < self.max_loras:
            return n
        return 0

    def pass_over(self, req: Request) -> int:
        if self._fits(req):
            return ADMIT
        skips = self._skips[req.request_id] = self._skips.get(req.request_id, 0) + 1
        return PASS_OVER_AND_STOP if skips >= self.max_lora_skips else PASS_OVER

    def admitted(self, req: Request) -> None:
        self._skips.pop(req.request_id, None)

    def scheduled(self, req: Request, n: int) -> None:
        if req.lora_id is not None:
            self._step_loras.add(req.lora_id)

    def finished(self, req: Request, free_blocks: bool) -> bool:
        self._skips.pop(req.request_id, None)
        return free_blocks

    def fill_stats(self, stats: SchedulerStats) -> None:
        if self.max_loras:
            running, waiting = self._queues()
            stats.running_lora_adapters = count_loras(running)
            stats.waiting_lora_adapters = count_loras(waiting)


def count_loras(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name (base-model requests are not counted)."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_id is not None:
            name = req.lora_name or str(req.lora_id)
            counts[name] = counts.get(name, 0) + 1
    return counts
