"""The simulation loop: a ``bench serve`` workload replayed in virtual time through the real
engine core.

``run_sim(cfg)`` builds the workload exactly as ``bench serve`` does
(``llmkit.tools.bench.datasets.build_workload``: same datasets, seeds and arrival times), an
``EngineCore`` with the real scheduler and KV cache manager and ``executor=sim``, both on one
``VirtualClock``, and then::

    loop:
        every request whose arrival time the clock has passed is sent (add_request), unless
        bench.max_concurrency requests are in flight: then it waits for one to finish
        (that wait is the record's queue_ms, not part of its TTFT — as in bench serve)
        nothing in flight: jump the clock to the next arrival
        EngineCore.step(): the scheduler schedules (timestamps: clock), the sim executor prices
        the step and advances the clock by its cost, the scheduler timestamps the new tokens
        finished requests become records (llmkit.tools.bench.metrics.request_record)

A request that arrives while a step runs is added when the step ends (an engine picks new
requests up between steps), but its TTFT counts from its arrival, when the client sent it.
``bench.max_duration_s``: requests not sent by then are dropped (``num_unsent``), those in
flight are aborted and recorded as failed, as ``bench serve`` does.
The result is ``llmkit.tools.bench.results.make_result(..., simulated=True)``: the same JSON and
figure as ``bench serve``, plus a ``sim`` block (hardware, model, cost-model constants, step
statistics). Nothing depends on the wall clock except ``sim.wall_s``: the same config and seed
give the same results.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from llmkit.config.errors import ConfigError
from llmkit.tools.bench.datasets import WorkloadError, WorkloadRequest, build_workload
from llmkit.tools.bench.metrics import RequestRecord, request_record, summarize
from llmkit.tools.sim.virtual_clock import VirtualClock

__all__ = ["SimRun", "build_sim_engine", "replay", "run_sim"]

logger = logging.getLogger(__name__)


@dataclass
class SimRun:
    """What one replay produced (records in workload order, for the requests that were sent)."""

    records: list[RequestRecord]
    duration_s: float
    num_unsent: int
    steps: int
    wall_s: float
    peak_kv_usage: float = 0.0
    peak_running: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def build_sim_engine(cfg: Any, clock: VirtualClock | None = None, *, model: Any = None,
                     hardware: Any = None):
    """``(EngineCore, SimExecutor, clock)`` for ``cfg`` (a ``SimToolConfig``): the real core with
    ``executor=sim``, the KV pool sized from the hardware unless ``kv_cache.num_blocks`` is
    set."""
    from llmkit.config.errors import ConfigError
    from llmkit.engine.loop.core import EngineCore
    from llmkit.platforms import resolve_platform
    from llmkit.tools.sim.executor import SimExecutor

    clock = clock or VirtualClock()
    engine = cfg.engine
    platform = resolve_platform(engine.platform)
    executor = SimExecutor(engine, platform, clock=clock, model=model, hardware=hardware,
                           settings=cfg)
    update: dict[str, Any] = {"executor": engine.executor.model_copy(update={"name": "sim",
                                                                             "target": None})}
    if engine.kv_cache.num_blocks is None:
        blocks = executor.num_kv_blocks()
        if blocks < 1:
            cm, hw = executor.cost_model, executor.hardware
            why = (f"{executor.model.name} in {cm.dtype} needs "
                   f"{cm.weight_bytes_per_device / 1e9:.1f} GB of weights per device; "
                   f"{hw.name} has {hw.memory_bytes / 1e9:.0f} GB x "
                   f"sim.gpu_memory_utilization={cfg.sim.gpu_memory_utilization}: raise "
                   "sim.tensor_parallel_size (or parallel.pipeline_parallel_size) or use a "
                   "smaller dtype (sim.dtype=fp8)")
            raise ConfigError("sim.tensor_parallel_size", cfg.sim.tensor_parallel_size, "",
                              message=why)
        update["kv_cache"] = engine.kv_cache.model_copy(update={"num_blocks": blocks})
    engine_cfg = engine.model_copy(update=update)
    core = EngineCore(engine_cfg, executor=executor, clock=clock)
    return core, executor, clock


def _sampling_params(cfg: Any, w: WorkloadRequest):
    from llmkit.sampling.params import SamplingParams

    b = cfg.bench
    return SamplingParams(max_tokens=w.max_tokens, ignore_eos=b.ignore_eos,
                          temperature=b.temperature)


def replay(cfg: Any, workload: Sequence[WorkloadRequest], core: Any, clock: VirtualClock
           ) -> SimRun:
    """Run ``workload`` through ``core`` on ``clock`` (see the module's docstring)."""
    from llmkit.request import Request, RequestStatus

    wall0 = time.perf_counter()
    b = cfg.bench
    limit = b.max_duration_s
    cap = b.max_concurrency
    max_steps = cfg.sim.max_steps
    todo = [w for w in workload if limit is None or w.arrival_s < limit]
    for w in todo:
        if w.prompt_token_ids is None:
            raise WorkloadError(f"request {w.request_id}: a text prompt with no tokenizer to "
                                "count its tokens; set bench.tokenizer=PATH")
    arrivals = deque(sorted(todo, key=lambda w: w.arrival_s))
    queued: deque[WorkloadRequest] = deque()  # arrived, waiting for a concurrency slot
    inflight: dict[str, tuple[WorkloadRequest, Any, float]] = {}
    records: dict[str, RequestRecord] = {}
    max_model_len = core.model_facts.max_model_len
    steps = 0
    idle_steps = 0
    peak_kv = 0.0
    peak_running = 0

    def finish(rid: str, error: str | None = None) -> None:
        w, req, sent = inflight.pop(rid)
        times = req.times
        n_out = req.num_output_tokens
        if error is None and req.status == RequestStatus.FINISHED_IGNORED:
            error = (f"prompt of {req.num_prompt_tokens} tokens is longer than max_model_len="
                     f"{max_model_len}")
        elif error is None and req.status == RequestStatus.FINISHED_ABORTED:
            error = "aborted by the engine"
        end = times.finished if times.finished is not None else clock()
        records[rid] = request_record(
            sent, list(times.token_times), end, output_tokens=n_out,
            prompt_tokens=req.num_prompt_tokens, ok=error is None and n_out > 0, error=error,
            request_id=rid, start_s=sent, queue_ms=max(0.0, 1e3 * (sent - w.arrival_s)))

    step_start = 0.0  # when the last step began, and how many requests were in flight then
    inflight_during_step = 0
    while True:
        now = clock()
        while arrivals and arrivals[0].arrival_s <= now:
            queued.append(arrivals.popleft())
        sent_during_step = 0
        while queued and (cap is None or len(inflight) < cap):
            w = queued.popleft()
            # The client sends at arrival unless bench.max_concurrency holds it back; the
            # engine takes it in between steps, so its TTFT includes the rest of the step it
            # arrived in (as a real server's does). One held back is sent when a request
            # finishes, at a step's end: now.
            sent = now
            if w.arrival_s > step_start and (
                    cap is None or inflight_during_step + sent_during_step < cap):
                sent = w.arrival_s
                sent_during_step += 1
            req = Request(w.request_id, w.prompt_token_ids, _sampling_params(cfg, w),
                          arrival_time=sent)
            inflight[w.request_id] = (w, req, sent)
            core.add_request(req)
        if limit is not None and now >= limit:
            for rid in list(inflight):
                core.abort_requests([rid])
                finish(rid, "cancelled: bench.max_duration_s reached")
            break
        if not core.has_unfinished_requests():
            if arrivals:
                clock.advance_to(arrivals[0].arrival_s)
                continue
            break
        before = step_start = clock()
        inflight_during_step = len(inflight)
        outputs = core.step()
        steps += 1
        for out in outputs:
            if out.finished and out.request_id in inflight:
                finish(out.request_id)
        stats = core.stats()
        peak_kv = max(peak_kv, stats.kv_usage)
        peak_running = max(peak_running, stats.num_running)
        if clock() == before and not outputs:
            idle_steps += 1
            if idle_steps > 3:
                if arrivals:  # nothing can run until someone else arrives
                    clock.advance_to(arrivals[0].arrival_s)
                    idle_steps = 0
                    continue
                raise RuntimeError(f"the simulation stalled at t={clock():.3f}s with "
                                   f"{len(inflight)} requests in flight and nothing scheduled")
        else:
            idle_steps = 0
        if max_steps is not None and steps >= max_steps:
            logger.warning("sim.max_steps=%d reached at t=%.3f s: %d requests in flight are "
                           "aborted", max_steps, clock(), len(inflight))
            for rid in list(inflight):
                core.abort_requests([rid])
                finish(rid, "aborted: sim.max_steps reached")
            break
    end = clock()
    duration = min(end, limit) if limit is not None else end
    ordered = [records[w.request_id] for w in workload if w.request_id in records]
    return SimRun(records=ordered, duration_s=duration, num_unsent=len(workload) - len(ordered),
                  steps=steps, wall_s=time.perf_counter() - wall0, peak_kv_usage=peak_kv,
                  peak_running=peak_running)


def run_sim(cfg: Any, *, sweep: Mapping[str, Any] | None = None, tokenizer: Any = None
            ) -> dict[str, Any]:
    """Simulate ``bench serve`` for ``cfg`` (a ``SimToolConfig``); returns the result document
    (``llmkit.tools.bench.results.make_result`` with ``simulated=True``)."""
    from llmkit.tools.bench.results import make_result
    from llmkit.tools.sim.hardware import resolve_hardware
    from llmkit.tools.sim.source import resolve_sim_model, workload_tokenizer

    if cfg.bench.lora_names:
        raise ConfigError("bench.lora_names", list(cfg.bench.lora_names), "", message=(
            "the simulator models no LoRA adapters (their cost is not in its cost model); "
            "leave bench.lora_names empty for llmkit sim"))
    model = resolve_sim_model(cfg)
    hardware = resolve_hardware(cfg)
    if tokenizer is None:
        tokenizer = workload_tokenizer(cfg, model)
    workload = build_workload(cfg.bench, tokenizer)
    core, executor, clock = build_sim_engine(cfg, model=model, hardware=hardware)
    try:
        run = replay(cfg, workload, core, clock)
    finally:
        core.shutdown()
    summary = summarize(run.records, cfg.slo, run.duration_s)
    summary["num_unsent"] = run.num_unsent
    config = {
        "bench": cfg.bench.model_dump(mode="json"),
        "slo": cfg.slo.model_dump(mode="json"),
        "served_model": model.name,
        "base_url": None,
        "sweep": dict(sweep or {}),
        "hardware": hardware.name,
        "sim": cfg.sim.model_dump(mode="json"),
        "scheduler": cfg.engine.scheduler.model_dump(mode="json", by_alias=True),
        "kv_cache": cfg.engine.kv_cache.model_dump(mode="json", by_alias=True),
        "seed": cfg.engine.seed,
        "speculative": cfg.engine.speculative.model_dump(mode="json", by_alias=True),
    }
    return make_result(config, summary, run.records, simulated=True, kind="sim",
                       sim=sim_block(core, executor, run))


def sim_block(core: Any, executor: Any, run: SimRun) -> dict[str, Any]:
    """The ``sim`` block of a result: what was modelled and how the steps went."""
    st = executor.stats
    cm = executor.cost_model
    busy = st.busy_s
    stats = core.stats()
    return {
        "hardware": executor.hardware.as_dict(),
        "hardware_file": executor.hardware.source_path,
        "model": executor.model.shape.summary(cm.dtype),
        "max_model_len": core.model_facts.max_model_len,
        "cost_model": cm.describe(),
        "num_kv_blocks": core.num_blocks,
        "kv_capacity_tokens": core.num_blocks * executor.block_size,
        # per KV-cache group: its spec, layers, bytes per token and per block (one rank)
        "kv_groups": cm.kv.describe(executor.block_size),
        "steps": run.steps,
        "priced_steps": st.steps,
        "virtual_time_s": run.duration_s,
        "busy_s": busy,
        "mean_step_ms": 1e3 * busy / st.steps if st.steps else None,
        "max_step_ms": 1e3 * st.max_step_s,
        "compute_bound_fraction": st.compute_bound_steps / st.steps if st.steps else None,
        # achieved fractions of peak over busy time (MFU / MBU, per rank)
        "mfu": st.flops / (busy * cm.peak_flops) if busy else None,
        "mbu": st.bytes / (busy * executor.hardware.memory_bandwidth) if busy else None,
        "tokens_computed": st.tokens,
        "num_preemptions": stats.num_preemptions_total,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "peak_kv_usage": run.peak_kv_usage,
        "peak_running": run.peak_running,
        "wall_s": run.wall_s,
        "spec_decode": _spec_block(executor, stats),
    }


def _spec_block(executor: Any, stats: Any) -> dict[str, Any] | None:
    spec = executor.speculation
    if spec is None:
        return None
    s = stats.spec_decode
    return {"method": spec.spec.name, "num_speculative_tokens": spec.k,
            "adaptive": spec.spec.adaptive, "ridge_tokens": spec.ridge,
            "acceptance_rates": spec.rates, "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_acceptance_length": s.mean_acceptance_length}
