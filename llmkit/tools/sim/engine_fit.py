"""``llmkit sim calibrate engine``: fit the cost model to timed steps of the real engine.

A torch microbenchmark gives the roofline a CPU *could* reach; a CPU engine runs far below it
(small-M GEMMs, a dozen eager ops per layer, paged attention, Python per request).
``llmkit.tools.sim.engine_measure`` times what the engine really does; this module fits the cost
model's terms to it:

1. **measure** (``measure_engine`` in ``llmkit.tools.sim.engine_measure``): timed steps of known
   shapes, grouped by shape (``group_samples``).

2. **fit** (``fit_engine``): the cost model of ``llmkit.cost_model.step_cost`` with this machine's
   measured peak FLOP/s ``F`` and bandwidth ``B``::

       step = max(FLOPs / (F·η_c), bytes / (B·η_m)) + t_0 + n·t_seq + T·t_token + C·t_context
              + t_eager·[eager]

   (``[eager]``: the step is no decode step of at most ``graph_rows`` rows, the engine's step
   graphs' reach; ``graph_rows=0``: no ``t_eager``), minimising the squared *relative* error
   over the groups: a grid over ``η_c``, ``η_m`` and, at each point, non-negative least
   squares for ``t_0, t_seq, t_token, t_context, t_eager`` (exact:
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
from dataclasses import dataclass, field
from typing import Any, Sequence

from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.model_shape import ModelShape
from llmkit.cost_model.step_cost import CostModel
from llmkit.tools.sim.engine_measure import StepSample, Work

__all__ = ["EngineFit", "StepGroup", "fit_engine", "group_samples"]

logger = logging.getLogger(__name__)

# the loss may exceed its minimum by this fraction to let higher efficiencies win
TIE_TOLERANCE = 0.01
LINEAR_TERMS = ("t_0", "t_seq", "t_token", "t_context", "t_eager")


def is_eager(work: Sequence[Work], graph_rows: int) -> bool:
    """Whether the engine runs this step eagerly: not a decode step (every row one token) of
    at most ``graph_rows`` rows."""
    return len(work) > graph_rows or any(q > 1 for q, _, _ in work)


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

    @property
    def key(self) -> str:
        """The shape's name in a profile's ``engine_steps_ms``."""
        return f"{self.label} n={self.num_seqs} T={self.num_tokens}"


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
    eager_s: float = 0.0  # t_eager (0 when graph_rows was 0)
    graph_rows: int = 0
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
               tie_tolerance: float = TIE_TOLERANCE, trim: bool = True,
               graph_rows: int = 0) -> EngineFit:
    """Fit ``η_c``, ``η_m`` and the linear terms to ``groups`` (see the module's docstring).
    ``base`` holds the measured peaks (its efficiencies and overheads are not used);
    ``control_plane_s`` caps the share of ``t_0`` that becomes ``step_overhead_ms``.

    The grid reaches past 1.0: a microbenchmark on a busy machine (or a model whose weights
    stay in cache) can measure less than the engine achieves. A fitted efficiency above 1
    raises the profile's peak (or bandwidth) to the rate the engine showed, efficiency 1.0.
    ``trim``: groups far off the first fit (a neighbour's burst of CPU use; more than
    max(25%, 4x the median error), at most a fifth of them) are left out of a second fit.
    ``graph_rows``: the engine's step graphs' rows (its dispatch's ``step_graph_max_rows``;
    0: none, no ``t_eager``)."""
    import numpy as np

    if not groups:
        raise ValueError("no engine steps to fit")
    cm = CostModel(shape, _zero_profile(base, dtype), dtype)
    costs = [cm.step(g.work) for g in groups]
    t = np.array([g.seconds for g in groups])
    comp = np.array([c.compute_s for c in costs])
    mem = np.array([c.memory_s for c in costs])
    X = np.array([[1.0, g.num_seqs, g.num_tokens, g.context]
                  + ([float(is_eager(g.work, graph_rows))] if graph_rows else [])
                  for g in groups])
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
    base_s, seq_s, token_s, context_s, eager_s = (max(0.0, float(x))
                                                  for x in [*coef, 0.0][:5])
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
        context_overhead_s=context_s, step_graph_max_rows=graph_rows if eager_s else 0,
        eager_step_s=eager_s, default_dtype=base.default_dtype,
        description=base.description, calibrated_at=base.calibrated_at)
    fitted = CostModel(shape, profile, dtype)  # the simulator's own equations, as it will run
    predicted = [fitted.step(g.work).total_s for g in groups]
    return EngineFit(compute_efficiency=min(eta_c, 1.0), memory_efficiency=min(eta_m, 1.0),
                     base_s=base_s, seq_s=seq_s, token_s=token_s, context_s=context_s,
                     step_overhead_s=step_s, layer_overhead_s=layer_s, groups=list(groups),
                     predicted_s=predicted, profile=profile, dtype=dtype, eager_s=eager_s,
                     graph_rows=graph_rows if eager_s else 0,
                     measured_peak_flops=base.peak(dtype),
                     measured_bandwidth=base.memory_bandwidth,
                     fitted=[bool(k) for k in keep])
