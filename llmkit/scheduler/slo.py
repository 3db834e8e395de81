"""``scheduler=slo``: the token-budget scheduler serving to ``slo.*``.

It is ``TokenBudgetScheduler`` with one more feature (``slo_policy.SloPolicy``: the step's
budget from the cost model's predicted step time, the waiting order by TTFT deadline, and
``scheduler.slo_admission``) and a waiting queue that feature arranges each step. Every other
feature (LoRA slots, drafts, images, grammars, KV connectors, preemption) works as under the
token-budget scheduler: the SLO decides how many tokens a step takes and who goes first, never
what a request computes, so outputs are the same tokens.

The engine builds it with ``slo=`` (the config's ``slo`` section) and ``step_time=`` (seconds
one step of given work takes: ``llmkit.cost_model`` for the profile ``scheduler.cost_profile``
names, or the simulator's own cost model under ``executor=sim``). The engine core hands each
step's measured time to ``update_from_output`` (``step_s``), from which the policy learns how
far the cost model's predictions are from the steps served (``slo_correction``).
"""
from __future__ import annotations

from typing import Any, ClassVar

from llmkit.config.schema import SchedulerConfig, SloConfig
from llmkit.kv_cache.base import KVCacheManagerBase
from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
from llmkit.scheduler.base import SchedulerOutput
from llmkit.scheduler.step_phases import WaitingQueue
from llmkit.scheduler.slo_policy import SloPolicy, StepTime
from llmkit.scheduler.slo_queue import ArrangedQueue
from llmkit.scheduler.token_budget import TokenBudgetScheduler

__all__ = ["SloScheduler"]


class SloScheduler(TokenBudgetScheduler):
    #: The engine passes ``slo=`` and ``step_time=`` to a scheduler class that sets this.
    serves_slo: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManagerBase, *,
                 slo: SloConfig | None = None, step_time: StepTime | None = None,
                 **kwargs: Any) -> None:
        slo = slo or SloConfig()
        if slo.tpot_ms is None and slo.ttft_ms is None:
            from llmkit.config.errors import ConfigError
            raise ConfigError("slo.tpot_ms", None, "a number of milliseconds > 0 (scheduler=slo "
                              "needs slo.tpot_ms and/or slo.ttft_ms)")
        if step_time is None:
            raise ValueError("SloScheduler needs step_time= (seconds one step of given work "
                             "takes): the engine builds it from the cost model")
        super().__init__(config, kv_cache_manager, **kwargs)
        self.slo_policy = SloPolicy(self, slo, step_time, config.slo_admission,
                                    min_chunk=kv_cache_manager.block_size,
                                    correction_weight=config.slo_correction_weight,
                                    tpot_mode=config.slo_tpot)
        self.add_feature(self.slo_policy)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput, *,
                           step_s: float | None = None) -> list[EngineCoreOutput]:
        if step_s is not None:
            self.slo_policy.observe_step(scheduler_output, step_s)
        return super().update_from_output(scheduler_output, model_runner_output)

    def make_waiting_queue(self) -> WaitingQueue:
        return ArrangedQueue()
