"""Timed steps of the real engine, for ``llmkit sim calibrate engine`` (fitted by
``llmkit.tools.sim.engine_fit``).

Build the real engine (``LLM`` for the configured model,
the same ``EngineCore``, scheduler, runner and attention backend that ``llmkit serve`` runs)
and time whole ``EngineCore.step()`` calls (schedule + forward + sample + update: what one
simulated step stands for) of known shapes, after a warm-up:

- prefill steps of single prompts (``prefill_lens``, default 64, 256, 1024 tokens; twice
  each);
- decode steps at batch ``decode_batches`` (1, 4, 16, 32) and context ``decode_contexts``
  (128, 512): a primer request computes the shared prefix once, then ``b`` requests that
  share it (prefix caching: their prefill is one token each) decode ``decode_steps`` tokens;
- a mixed phase (twice): 8 decoders while fresh 128- and 256-token prompts join (the
  scheduler mixes their prefill into the decode steps, as under a serving load).

Each step's work is read from its ``SchedulerOutput`` as ``executor=sim`` reads it (``q_i`` new
tokens, context ``c_i`` after the step) and whether it sampled from its ``ModelRunnerOutput``,
by a step observer on the engine core (``llmkit/engine/observe/observer.py``), which also times it. Steps of one shape are grouped; a group's time is its lower median
(robust to a neighbour's burst of CPU use on a shared machine).
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llmkit.cost_model.model_shape import ModelShape

__all__ = ["EngineMeasurement", "StepSample", "Work", "engine_dtype", "measure_engine"]

logger = logging.getLogger(__name__)

Work = tuple[int, int, bool]  # (new tokens q, context after the step c, samples)

PREFILL_LENS = (64, 256, 1024)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (128, 512)
DECODE_STEPS = 5
PREFILL_REPS = 2
MIXED_BATCH = 8
MIXED_PROMPTS = (128, 256)

@dataclass(slots=True)
class StepSample:
    phase: str
    work: list[Work]
    seconds: float


@dataclass
class EngineMeasurement:
    model_name: str
    shape: ModelShape
    dtype: str  # what the engine ran (model.dtype, or the platform's choice for auto)
    samples: list[StepSample]
    load_s: float
    measure_s: float
    threads: int
    attention: str
    skipped: list[str] = field(default_factory=list)
    # decode steps of up to this many rows ran as a step graph (0: none did)
    graph_rows: int = 0


def _graph_rows(core: Any) -> int:
    """The rows the engine's step graphs cover (0 without graphs); they are ready: the
    measured engine waits for them (compilation.background=false)."""
    runner = getattr(core.executor, "runner", None)
    graphs = getattr(runner, "step_graphs", None)
    return int(getattr(graphs, "max_rows", 0) or 0)


class _Recorder:
    """A step observer: each step's work and its time (schedule + execute + update)."""

    def __init__(self) -> None:
        self.samples: list[StepSample] = []
        self.phase: str | None = None

    def on_step(self, event: Any) -> None:
        so = event.scheduler_output
        before = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        ro = event.runner_output
        sampled = {rid: bool(t) for rid, t in zip(ro.req_ids, ro.sampled_token_ids)}
        work = [(q, before[rid] + q, sampled.get(rid, False))
                for rid, q in so.num_scheduled_tokens.items() if q > 0]
        if self.phase is not None and work:
            self.samples.append(StepSample(self.phase, work, event.step_s))


class _Driver:
    def __init__(self, core: Any, vocab_size: int, temperature: float, seed: int) -> None:
        self.core = core
        self.vocab = vocab_size
        self.temperature = temperature
        self.rng = random.Random(f"llmkit-calibrate-{seed}")
        self.ids = itertools.count()
        self.recorder = _Recorder()

    def prompt(self, n: int) -> list[int]:
        """``n`` random ids (fresh prompts never share a cached block)."""
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from llmkit.request import Request
        from llmkit.sampling.params import SamplingParams

        rid = f"calibrate-{next(self.ids)}"
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                  temperature=self.temperature),
                      eos_token_id=self.core.model_facts.eos_token_id)
        self.core.add_request(req)

    def step(self, phase: str | None) -> None:
        self.recorder.phase = phase
        self.core.step()

    def drain(self, phase: str | None) -> None:
        while self.core.has_unfinished_requests():
            self.step(phase)


def engine_dtype(cfg: Any) -> str:
    """The dtype the real engine of ``cfg`` runs (``model.dtype``; for auto the platform's)."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    from llmkit.platforms import resolve_platform
    return str(resolve_platform(cfg.platform).preferred_dtype()).replace("torch.", "")


def measure_engine(cfg: Any, *, prefill_lens: Sequence[int] = PREFILL_LENS,
                   decode_batches: Sequence[int] = DECODE_BATCHES,
                   decode_contexts: Sequence[int] = DECODE_CONTEXTS,
                   decode_steps: int = DECODE_STEPS, prefill_reps: int = PREFILL_REPS,
                   mixed: bool = True, budget_s: float = 120.0,
                   log: Callable[[str], None] | None = None) -> EngineMeasurement:
    """Time the real engine of ``cfg`` (a ``SimToolConfig``: its engine, and ``bench.temperature``)
    on steps of known shapes (see the module's docstring). Shapes are capped by the model's ``max_model_len`` and
    ``scheduler.max_num_seqs``; phases left when ``budget_s`` is spent are skipped (named in
    ``skipped``)."""
    import torch

    from llmkit.engine.llm import LLM

    log = log or (lambda s: None)
    # prefix caching gives each decode batch its shared context without recomputing it; the
    # step graphs are waited for (a served engine runs them: on a cold compile cache they would
    # otherwise compile beside the timed steps, which would time eager steps, slower)
    engine_cfg = cfg.engine.model_copy(update={
        "kv_cache": cfg.engine.kv_cache.model_copy(update={"enable_prefix_caching": True}),
        "compilation": cfg.engine.compilation.model_copy(update={"background": False})})
    t_load = time.perf_counter()
    llm = LLM.from_config(engine_cfg)
    load_s = time.perf_counter() - t_load
    core = llm.engine
    source = llm.model_source
    name = engine_cfg.model.served_name or engine_cfg.model.name or source.path.stem
    if name == "custom":
        name = source.path.stem if source.is_gguf else source.path.name
    shape = ModelShape.from_hf_config(source.hf_config, name=name)
    dtype = engine_dtype(engine_cfg)
    attention = core.backend_info.attention
    graph_rows = _graph_rows(core)
    log(f"engine: {name} ({shape.num_params / 1e6:.0f} M params, {dtype}, "
        f"{torch.get_num_threads()} threads), loaded in {load_s:.1f} s")

    max_len = core.model_facts.max_model_len
    block = engine_cfg.kv_cache.block_size
    max_seqs = engine_cfg.scheduler.max_num_seqs
    drv = _Driver(core, shape.vocab_size, cfg.bench.temperature, engine_cfg.seed)
    core.add_step_observer(drv.recorder)
    t0 = time.perf_counter()
    skipped: list[str] = []

    def room(n: int) -> int:  # a prompt of n tokens that leaves room to decode
        return max(1, min(n, max_len - decode_steps - 2))

    def prefill(n: int) -> None:
        for _ in range(prefill_reps):
            drv.add(drv.prompt(n), 1)
            drv.drain(f"prefill {n}")

    prefixes: dict[int, list[int]] = {}

    def decode(ctx: int, b: int) -> None:
        if ctx not in prefixes:
            prefixes[ctx] = drv.prompt(ctx)
            drv.add(prefixes[ctx] + drv.prompt(1), 1)  # computes the shared prefix once
            drv.drain(f"prefill {ctx + 1}")
        for _ in range(b):
            drv.add(prefixes[ctx] + drv.prompt(1), decode_steps + 1)
        drv.drain(f"decode b={b} ctx={ctx}")

    def mix(ctx: int, b: int) -> None:
        if ctx not in prefixes:
            decode(ctx, 1)
        label = f"mixed b={b} ctx={ctx}"
        fresh = [room(p) for p in MIXED_PROMPTS]
        for _ in range(prefill_reps):
            for _ in range(b):
                drv.add(prefixes[ctx] + drv.prompt(1), 2 * len(fresh) + 3)
            drv.step(label)
            for p in fresh:  # a fresh prompt joins the decoders: one mixed step, one decode
                drv.add(drv.prompt(p), 2)
                drv.step(label)
                drv.step(label)
            drv.drain(label)

    lens = sorted({room(n) for n in prefill_lens})
    contexts = sorted({max(block, room(c) // block * block) for c in decode_contexts})
    batches = sorted({max(1, min(b, max_seqs)) for b in decode_batches})
    phases: list[tuple[str, Callable[[], None]]] = []
    phases += [(f"prefill {n}", lambda n=n: prefill(n)) for n in lens[:-1]]
    for i, ctx in enumerate(contexts):
        phases += [(f"decode b={b} ctx={ctx}", lambda c=ctx, b=b: decode(c, b))
                   for b in batches]
        if i == 0 and mixed:
            mb = max(1, min(MIXED_BATCH, max_seqs - len(MIXED_PROMPTS)))
            phases.append((f"mixed b={mb} ctx={ctx}", lambda c=ctx, b=mb: mix(c, b)))
    if lens:
        phases.append((f"prefill {lens[-1]}", lambda n=lens[-1]: prefill(n)))
    try:
        # warm-up (not recorded): first calls allocate, build kernels and fill caches
        for _ in range(2):
            drv.add(drv.prompt(room(32)), 3)
        drv.drain(None)
        drv.add(drv.prompt(room(256)), 1)
        drv.drain(None)
        for label, run in phases:
            if time.perf_counter() - t0 > budget_s:
                skipped.append(label)
                continue
            n0 = len(drv.recorder.samples)
            t_phase = time.perf_counter()
            run()
            new = drv.recorder.samples[n0:]
            log(f"  {label}: {len(new)} steps in {time.perf_counter() - t_phase:.1f} s")
        if skipped:
            log(f"  budget of {budget_s:.0f} s spent: skipped {', '.join(skipped)}")
    finally:
        core.remove_step_observer(drv.recorder)
        llm.shutdown()
    return EngineMeasurement(model_name=name, shape=shape, dtype=dtype,
                             samples=list(drv.recorder.samples), load_s=load_s,
                             measure_s=time.perf_counter() - t0,
                             threads=torch.get_num_threads(), attention=attention,
                             skipped=skipped, graph_rows=graph_rows)


# ----------------------------------------------------------------------------- fitting
