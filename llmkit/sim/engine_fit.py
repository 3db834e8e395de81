"""``llmkit sim calibrate engine``: fit the cost model to timed steps of the real engine.

A torch microbenchmark gives the roofline a CPU *could* reach; a CPU engine runs far below it
(small-M GEMMs, a dozen eager ops per layer, paged attention in torch, Python per request).
This module measures what the engine really does and fits the cost model's terms to it:

1. **measure** (``measure_engine``): build the real engine (``LLM`` for the configured model,
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

   Each step's work is read from its ``SchedulerOutput`` exactly as ``executor=sim`` reads it
   (``q_i`` new tokens, context ``c_i`` after the step, whether it samples), through the engine
   core's step-trace hooks. Steps of one shape are grouped; a group's time is its lower median
   (robust to a neighbour's burst of CPU use on a shared machine).

2. **fit** (``fit_engine``): the cost model of ``llmkit.sim.cost_model`` with this machine's
   measured peak FLOP/s ``F`` and bandwidth ``B``::

       step = max(FLOPs / (F·η_c), bytes / (B·η_m)) + t_0 + n·t_seq + T·t_token + C·t_context

   minimising the squared *relative* error over the groups: a grid over ``η_c``, ``η_m`` and,
   at each point, non-negative least squares for ``t_0, t_seq, t_token, t_context`` (exact:
   every support set solved, the best feasible one kept). Where the data cannot tell the
   roofline from a linear overhead (the loss within 1% of its minimum), the efficiencies
   closest to 1 win: the roofline keeps what the measured hardware must spend, the overheads
   take the rest. An efficiency above 1 (the engine beat a microbenchmark run on a busy
   machine, or its weights stay in cache) raises the profile's peak or bandwidth instead.
   Groups far off the fit (a neighbour's burst of CPU use) are left out of a second fit.
   ``t_0`` splits into ``step_overhead_ms`` (up to the measured control plane of one step) and
   ``layer_overhead_us`` (the rest, per layer).

The fitted profile then reproduces the engine's measured step times within the fit's error
(printed, and written as comments into the profile). It describes *this* machine running *this*
engine build: re-run it after the engine changes (``llmkit sim calibrate engine``).
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from llmkit.sim.cost_model import CostModel
from llmkit.sim.hardware import HardwareProfile
from llmkit.sim.model_shape import ModelShape

__all__ = ["EngineFit", "EngineMeasurement", "StepGroup", "StepSample", "engine_dtype",
           "fit_engine", "group_samples", "measure_engine"]

logger = logging.getLogger(__name__)

Work = tuple[int, int, bool]  # (new tokens q, context after the step c, samples)

PREFILL_LENS = (64, 256, 1024)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (128, 512)
DECODE_STEPS = 5
PREFILL_REPS = 2
MIXED_BATCH = 8
MIXED_PROMPTS = (128, 256)
# the loss may exceed its minimum by this fraction to let higher efficiencies win
TIE_TOLERANCE = 0.01
LINEAR_TERMS = ("t_0", "t_seq", "t_token", "t_context")


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


@dataclass(slots=True)
class StepGroup:
    label: str
    work: list[Work]  # the step whose time is the group's
    seconds: float  # lower median of the group's steps
    count: int

    @property
    def num_seqs(self) -> int:
        return len(self.work)

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _, _ in self.work)

    @property
    def context(self) -> int:
        return sum(c for _, c, _ in self.work)


@dataclass
class EngineFit:
    compute_efficiency: float
    memory_efficiency: float
    base_s: float  # t_0: per step, before its split into step and layer overheads
    seq_s: float
    token_s: float
    context_s: float
    step_overhead_s: float
    layer_overhead_s: float
    groups: list[StepGroup]
    predicted_s: list[float]  # by the fitted profile through CostModel, per group
    profile: HardwareProfile  # the measured peaks (raised where the engine beat them) + terms
    dtype: str = "float32"
    measured_peak_flops: float = 0.0  # the microbenchmark's, for dtype
    measured_bandwidth: float = 0.0
    fitted: list[bool] = field(default_factory=list)  # False: left out as an outlier

    @property
    def rel_errors(self) -> list[float]:
        return [p / g.seconds - 1.0 for p, g in zip(self.predicted_s, self.groups)]

    def _fitted_errors(self) -> list[float]:
        keep = self.fitted or [True] * len(self.groups)
        return [e for e, k in zip(self.rel_errors, keep) if k]

    @property
    def rms_rel_error(self) -> float:
        """Over the groups fitted (outliers left out)."""
        e = self._fitted_errors()
        return (sum(x * x for x in e) / len(e)) ** 0.5 if e else 0.0

    @property
    def max_rel_error(self) -> float:
        return max((abs(x) for x in self._fitted_errors()), default=0.0)

    @property
    def num_outliers(self) -> int:
        return sum(1 for k in self.fitted if not k)

    def table(self) -> list[str]:
        """One line per group: shape, measured and modelled ms, error."""
        lines = []
        keep = self.fitted or [True] * len(self.groups)
        for g, p, e, k in zip(self.groups, self.predicted_s, self.rel_errors, keep):
            lines.append(f"{g.label:<22} n={g.num_seqs:<3} T={g.num_tokens:<5} "
                         f"C={g.context:<6} x{g.count}: measured {1e3 * g.seconds:8.2f} ms, "
                         f"model {1e3 * p:8.2f} ms ({100 * e:+.1f}%)"
                         + ("" if k else "  outlier, not fitted"))
        return lines


# ----------------------------------------------------------------------------- measuring

class _Recorder:
    """Stands in for ``EngineCore.step_trace``: times each step and reads its work."""

    def __init__(self, requests: dict[str, Any]) -> None:
        self.requests = requests
        self.samples: list[StepSample] = []
        self.phase: str | None = None
        self._t0 = 0.0
        self._work: list[Work] = []

    def begin_step(self) -> None:
        self._t0 = time.perf_counter()

    def scheduled(self, scheduler_output: Any, scheduler: Any) -> None:
        so = scheduler_output
        before = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        work = []
        for rid, q in so.num_scheduled_tokens.items():
            if q <= 0:
                continue
            c = before[rid] + q
            work.append((q, c, c >= self.requests[rid].num_tokens))  # as executor=sim reads it
        self._work = work

    def executed(self) -> None:
        pass

    def end_step(self, scheduler: Any) -> None:
        t = time.perf_counter() - self._t0
        if self.phase is not None and self._work:
            self.samples.append(StepSample(self.phase, self._work, t))
        self._work = []

    def close(self) -> None:
        pass


class _Driver:
    def __init__(self, core: Any, vocab_size: int, temperature: float, seed: int) -> None:
        self.core = core
        self.vocab = vocab_size
        self.temperature = temperature
        self.rng = random.Random(f"llmkit-calibrate-{seed}")
        self.ids = itertools.count()
        self.requests: dict[str, Any] = {}
        self.recorder = _Recorder(self.requests)

    def prompt(self, n: int) -> list[int]:
        """``n`` random ids (fresh prompts never share a cached block)."""
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from llmkit.request import Request
        from llmkit.sampling.params import SamplingParams

        rid = f"calibrate-{next(self.ids)}"
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                  temperature=self.temperature),
                      eos_token_id=self.core.eos_token_id)
        self.requests[rid] = req
        self.core.add_request(req)

    def step(self, phase: str | None) -> None:
        self.recorder.phase = phase
        self.core.step()

    def drain(self, phase: str | None) -> None:
        while self.core.has_unfinished_requests():
            self.step(phase)
        self.requests.clear()


def engine_dtype(cfg: Any) -> str:
    """The dtype the real engine of ``cfg`` runs (``model.dtype``; for auto the platform's)."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    from llmkit.platforms import resolve_platform
    return str(resolve_platform(cfg.platform).default_dtype).replace("torch.", "")


def measure_engine(cfg: Any, *, prefill_lens: Sequence[int] = PREFILL_LENS,
                   decode_batches: Sequence[int] = DECODE_BATCHES,
                   decode_contexts: Sequence[int] = DECODE_CONTEXTS,
                   decode_steps: int = DECODE_STEPS, prefill_reps: int = PREFILL_REPS,
                   mixed: bool = True, budget_s: float = 120.0,
                   log: Callable[[str], None] | None = None) -> EngineMeasurement:
    """Time the real engine of ``cfg`` (an ``EngineConfig``) on steps of known shapes (see the
    module's docstring). Shapes are capped by the model's ``max_model_len`` and
    ``scheduler.max_num_seqs``; phases left when ``budget_s`` is spent are skipped (named in
    ``skipped``)."""
    import torch

    from llmkit.engine.llm import LLM

    log = log or (lambda s: None)
    # prefix caching gives each decode batch its shared context without recomputing it
    cfg = cfg.model_copy(update={"kv_cache": cfg.kv_cache.model_copy(
        update={"enable_prefix_caching": True})})
    t_load = time.perf_counter()
    llm = LLM.from_config(cfg)
    load_s = time.perf_counter() - t_load
    core = llm.engine
    source = llm.model_source
    name = cfg.model.served_name or cfg.model.name or source.path.stem
    if name == "custom":
        name = source.path.stem if source.is_gguf else source.path.name
    shape = ModelShape.from_hf_config(source.hf_config, name=name)
    dtype = engine_dtype(cfg)
    backend = getattr(getattr(core.executor, "runner", None), "attn_backend", None)
    attention = type(backend).__name__ if backend is not None else cfg.attention.name
    log(f"engine: {name} ({shape.num_params / 1e6:.0f} M params, {dtype}, "
        f"{torch.get_num_threads()} threads), loaded in {load_s:.1f} s")

    max_len = core.max_model_len
    block = cfg.kv_cache.block_size
    max_seqs = cfg.scheduler.max_num_seqs
    drv = _Driver(core, shape.vocab_size, cfg.bench.temperature, cfg.seed)
    saved_trace = core.step_trace
    core.step_trace = drv.recorder  # the core's step hooks, timing each step
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
        core.step_trace = saved_trace
        llm.shutdown()
    return EngineMeasurement(model_name=name, shape=shape, dtype=dtype,
                             samples=list(drv.recorder.samples), load_s=load_s,
                             measure_s=time.perf_counter() - t0,
                             threads=torch.get_num_threads(), attention=attention,
                             skipped=skipped)


# ----------------------------------------------------------------------------- fitting

def group_samples(samples: Sequence[StepSample]) -> list[StepGroup]:
    """Steps of one phase with the same batch, tokens and samplers, as one group timed by the
    lower median (the minimum of two, the median of an odd count)."""
    groups: dict[tuple, list[StepSample]] = {}
    for s in samples:
        key = (s.phase, len(s.work), sum(q for q, _, _ in s.work),
               sum(1 for *_, smp in s.work if smp))
        groups.setdefault(key, []).append(s)
    out = []
    for (phase, *_), members in groups.items():
        ranked = sorted(members, key=lambda s: s.seconds)
        pick = ranked[(len(ranked) - 1) // 2]
        out.append(StepGroup(phase, pick.work, pick.seconds, len(members)))
    return out


def _zero_profile(base: HardwareProfile, dtype: str) -> HardwareProfile:
    """``base``'s peak for ``dtype`` and bandwidth, efficiencies 1, no overheads."""
    return HardwareProfile(name=base.name, peak_flops={dtype: base.peak(dtype)},
                           memory_bytes=base.memory_bytes,
                           memory_bandwidth=base.memory_bandwidth, compute_efficiency=1.0,
                           memory_efficiency=1.0)


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _solve(comp: Any, mem: Any, X: Any, t: Any, ec: Any, em: Any, tie_tolerance: float
           ) -> tuple[float, float, Any]:
    """The grid + exact NNLS of the module's docstring: ``(η_c, η_m, linear coefficients)``."""
    import numpy as np

    # roofline of every group at every grid point: (G, K), K = |ec|·|em|
    roof = np.maximum(comp[:, None, None] / ec[None, :, None],
                      mem[:, None, None] / em[None, None, :]).reshape(len(t), -1)
    w = 1.0 / t
    Yw = (t[:, None] - roof) * w[:, None]  # what the linear terms must explain, relative
    Xw = X * w[:, None]
    scale = np.linalg.norm(Xw, axis=0)
    scale[scale == 0] = 1.0
    Xs = Xw / scale
    k = X.shape[1]
    best_loss = np.full(Yw.shape[1], np.inf)
    best_coef = np.zeros((k, Yw.shape[1]))
    for r in range(k + 1):
        for support in itertools.combinations(range(k), r):
            cols = list(support)
            if cols:
                A = Xs[:, cols]
                coef = np.linalg.pinv(A) @ Yw
                resid = Yw - A @ coef
                ok = (coef >= 0).all(axis=0)
            else:
                coef = np.zeros((0, Yw.shape[1]))
                resid = Yw
                ok = np.ones(Yw.shape[1], dtype=bool)
            loss = np.where(ok, (resid ** 2).sum(axis=0), np.inf)
            better = loss < best_loss
            if better.any():
                best_loss = np.where(better, loss, best_loss)
                full = np.zeros((k, Yw.shape[1]))
                full[cols] = coef
                best_coef[:, better] = full[:, better]
    # near-ties: the efficiencies closest to the measured peaks (1.0) win
    near = np.flatnonzero(best_loss <= best_loss.min() * (1.0 + tie_tolerance) + 1e-15)
    ic, im = np.divmod(near, len(em))
    pick = near[np.argmin(np.abs(np.log(ec[ic])) + np.abs(np.log(em[im])))]
    return float(ec[pick // len(em)]), float(em[pick % len(em)]), best_coef[:, pick] / scale


def fit_engine(shape: ModelShape, dtype: str, base: HardwareProfile,
               groups: Sequence[StepGroup], *, control_plane_s: float = 0.0,
               eta_compute: Sequence[float] | None = None,
               eta_memory: Sequence[float] | None = None,
               tie_tolerance: float = TIE_TOLERANCE, trim: bool = True) -> EngineFit:
    """Fit ``η_c``, ``η_m`` and the linear terms to ``groups`` (see the module's docstring).
    ``base`` holds the measured peaks (its efficiencies and overheads are not used);
    ``control_plane_s`` caps the share of ``t_0`` that becomes ``step_overhead_ms``.

    The grid reaches past 1.0: a microbenchmark on a busy machine (or a model whose weights
    stay in cache) can measure less than the engine achieves. A fitted efficiency above 1
    raises the profile's peak (or bandwidth) to the rate the engine showed, efficiency 1.0.
    ``trim``: groups far off the first fit (a neighbour's burst of CPU use; more than
    max(25%, 4x the median error), at most a fifth of them) are left out of a second fit."""
    import numpy as np

    if not groups:
        raise ValueError("no engine steps to fit")
    cm = CostModel(shape, _zero_profile(base, dtype), dtype)
    costs = [cm.step(g.work) for g in groups]
    t = np.array([g.seconds for g in groups])
    comp = np.array([c.compute_s for c in costs])
    mem = np.array([c.memory_s for c in costs])
    X = np.array([[1.0, g.num_seqs, g.num_tokens, g.context] for g in groups])
    ec = np.array(eta_compute if eta_compute is not None else _geomspace(1e-3, 1e2, 151))
    em = np.array(eta_memory if eta_memory is not None else _geomspace(1e-2, 1e2, 121))
    keep = np.ones(len(groups), dtype=bool)
    for attempt in range(2):
        eta_c, eta_m, coef = _solve(comp[keep], mem[keep], X[keep], t[keep], ec, em,
                                    tie_tolerance)
        pred = np.maximum(comp / eta_c, mem / eta_m) + X @ coef
        err = np.abs(pred / t - 1.0)
        if attempt or not trim or len(groups) < 5:
            break
        limit = max(0.25, 4.0 * float(np.median(err)))
        worst = [i for i in np.argsort(-err)[:len(groups) // 5] if err[i] > limit]
        if not worst:
            break
        keep[worst] = False
    base_s, seq_s, token_s, context_s = (max(0.0, float(x)) for x in coef)
    peak = base.peak(dtype) * max(eta_c, 1.0)
    bandwidth = base.memory_bandwidth * max(eta_m, 1.0)
    step_s = min(base_s, max(control_plane_s, 0.0))
    layer_s = (base_s - step_s) / shape.num_layers
    profile = HardwareProfile(
        name=base.name, peak_flops={**base.peak_flops, dtype: peak},
        memory_bytes=base.memory_bytes, memory_bandwidth=bandwidth,
        compute_efficiency=min(eta_c, 1.0), memory_efficiency=min(eta_m, 1.0),
        link_bandwidth=base.link_bandwidth, link_latency_s=base.link_latency_s,
        link_efficiency=base.link_efficiency, step_overhead_s=step_s,
        layer_overhead_s=layer_s, seq_overhead_s=seq_s, token_overhead_s=token_s,
        context_overhead_s=context_s, default_dtype=base.default_dtype,
        description=base.description, calibrated_at=base.calibrated_at)
    fitted = CostModel(shape, profile, dtype)  # the simulator's own equations, as it will run
    predicted = [fitted.step(g.work).total_s for g in groups]
    return EngineFit(compute_efficiency=min(eta_c, 1.0), memory_efficiency=min(eta_m, 1.0),
                     base_s=base_s, seq_s=seq_s, token_s=token_s, context_s=context_s,
                     step_overhead_s=step_s, layer_overhead_s=layer_s, groups=list(groups),
                     predicted_s=predicted, profile=profile, dtype=dtype,
                     measured_peak_flops=base.peak(dtype),
                     measured_bandwidth=base.memory_bandwidth,
                     fitted=[bool(k) for k in keep])
