"""One candidate of ``llmkit plan`` simulated: the engine's real scheduler and KV cache on the
cost model, replaying the plan's workload (``llmkit.tools.sim.replay``).

The model shape, hardware profile and workload are resolved once per plan (``SimContext``),
so a candidate costs one composition and one replay. Data parallelism (which the simulator's
engine does not model) is simulated as DP independent replicas, request ``i`` going to replica
``i % DP`` (the engine's round robin), each replica a copy of the profiled hardware; the
figures are over all their records, the duration the longest replica's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llmkit.config.errors import ConfigError
from llmkit.tools.plan.space import Candidate

__all__ = ["Prediction", "SimContext", "run_search", "simulate"]

@dataclass
class Prediction:
    """What the simulator predicts for one candidate (``summary``: ``bench serve``'s keys), or
    why it could not run (``error``)."""

    candidate: Candidate
    summary: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float = 0.0
    # the cores (CPU) or devices (GPU profile) the configuration occupies
    cores: int = 1
    sim: dict[str, Any] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return float(self.summary["goodput"]) if self.summary else 0.0

    @property
    def tokens_per_core_s(self) -> float:
        """Cost: output tokens per core-second (per device-second on a GPU profile)."""
        s = self.summary
        if not s or not s.get("duration_s"):
            return 0.0
        return s["total_output_tokens"] / (s["duration_s"] * self.cores)


@dataclass
class SimContext:
    """What every candidate of a plan shares: the simulated model, hardware, workload."""

    model: Any
    hardware: Any
    workload: list
    # a CPU profile: an engine's threads use every core whatever its split
    cpu_cores: int | None

    @classmethod
    def build(cls, cfg: Any, cores: int) -> "SimContext":
        from llmkit.cost_model.hardware import CALIBRATED_NAME
        from llmkit.tools.bench.datasets import build_workload
        from llmkit.tools.sim.hardware import resolve_hardware
        from llmkit.tools.sim.source import resolve_sim_model, workload_tokenizer

        model = resolve_sim_model(cfg)
        hardware = resolve_hardware(cfg)
        workload = build_workload(cfg.bench, workload_tokenizer(cfg, model))
        cpu = hardware.name == CALIBRATED_NAME
        return cls(model, hardware, workload, cores if cpu else None)


def _sim_config(cfg: Any, cand: Candidate) -> Any:
    """The candidate's composed config as the simulator runs it: weights in the quantized
    dtype, the KV pool in the cache dtype, one data-parallel replica."""
    sim = cfg.sim
    if cand.quantization in ("int8", "fp8") and sim.dtype == "auto":
        sim = sim.model_copy(update={"dtype": cand.quantization})
    engine = cfg.engine
    parallel = engine.parallel.model_copy(update={"data_parallel_size": 1})
    engine = engine.model_copy(update={"parallel": parallel})
    return cfg.model_copy(update={"sim": sim, "engine": engine})


def _replicas(workload: Sequence[Any], dp: int) -> list[list[Any]]:
    return [list(workload[i::dp]) for i in range(dp)]


def simulate(cfg: Any, cand: Candidate, ctx: SimContext) -> Prediction:
    """Simulate ``cand`` (``cfg``: its composed ``PlanToolConfig``); a candidate the simulator
    or the engine rejects becomes a ``Prediction`` with its ``error``."""
    from llmkit.cost_model.model_shape import ShapeError
    from llmkit.tools.bench.datasets import WorkloadError
    from llmkit.tools.bench.metrics import summarize
    from llmkit.tools.sim.replay import build_sim_engine, replay

    t0 = time.perf_counter()
    pred = Prediction(cand, cores=ctx.cpu_cores or cand.devices)
    try:
        scfg = _sim_config(cfg, cand)
        records, duration, unsent, steps, preempt = [], 0.0, 0, 0, 0
        for part in _replicas(ctx.workload, cand.data_parallel_size):
            if not part:
                continue
            core, executor, clock = build_sim_engine(scfg, model=ctx.model,
                                                     hardware=ctx.hardware)
            try:
                run = replay(scfg, part, core, clock)
                preempt += core.stats().num_preemptions_total
            finally:
                core.shutdown()
            records += run.records
            duration = max(duration, run.duration_s)
            unsent += run.num_unsent
            steps += run.steps
        summary = summarize(records, cfg.slo, duration)
        summary["num_unsent"] = unsent
        pred.summary = summary
        pred.sim = {"steps": steps, "num_preemptions": preempt}
    except (ConfigError, WorkloadError, ShapeError, ValueError, RuntimeError) as e:
        pred.error = f"{type(e).__name__}: {e}".splitlines()[0]
    pred.wall_s = time.perf_counter() - t0
    return pred


def run_search(candidates: Sequence[Candidate], compose: Callable[[Candidate], Any],
               ctx: SimContext, log: Callable[[str], None] | None = None
               ) -> list[Prediction]:
    """Simulate every candidate in order (``compose``: a candidate's ``PlanToolConfig``),
    logging one progress line each."""
    preds = []
    n = len(candidates)
    for i, cand in enumerate(candidates):
        try:
            cfg = compose(cand)
        except ConfigError as e:
            pred = Prediction(cand, error=f"ConfigError: {e}", cores=cand.devices)
        else:
            pred = simulate(cfg, cand, ctx)
        preds.append(pred)
        if log is not None:
            what = (f"error: {pred.error}" if pred.error else
                    f"goodput {pred.goodput:.3f} req/s, "
                    f"{pred.tokens_per_core_s:.1f} tok/core-s")
            log(f"[{i + 1}/{n}] {cand.label()}: {what} ({pred.wall_s:.1f} s)")
    return preds
