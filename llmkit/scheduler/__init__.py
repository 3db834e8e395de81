"""Schedulers, picked by ``scheduler.name``."""
from llmkit.registry import Registry
from llmkit.scheduler.base import (CachedRequestData, NewRequestData, Scheduler, SchedulerOutput,
                                   SchedulerStats)
from llmkit.scheduler.token_budget import TokenBudgetScheduler

SCHEDULERS: Registry[Scheduler] = Registry("scheduler")
SCHEDULERS.register("token_budget")(TokenBudgetScheduler)
# serves to slo.* with the cost model's predicted step times (llmkit/scheduler/slo.py)
SCHEDULERS.register_lazy("slo", "llmkit.scheduler.slo.SloScheduler")

__all__ = ["SCHEDULERS", "CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput",
           "SchedulerStats", "TokenBudgetScheduler"]
