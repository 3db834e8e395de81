"""The cost model's eager-step term: a CPU engine runs decode steps of up to
``step_graph_max_rows`` rows as a compiled step graph and every other step eagerly, which costs
a fixed amount more per step (``eager_step_overhead_ms``); `llmkit sim calibrate engine` fits it.
Deterministic: profiles made up here, step times computed by the cost model itself."""
from __future__ import annotations

import pytest

from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.step_cost import CostModel
from llmkit.tools.sim.engine_fit import StepGroup, fit_engine, is_eager

from helpers.served_trace import smol_shape

EAGER = 9e-3


def _cpu(**kw) -> HardwareProfile:
    base = dict(name="cpu-local", peak_flops={"float32": 150e9}, memory_bytes=16e9,
                memory_bandwidth=25.6e9, compute_efficiency=1.0, memory_efficiency=1.0)
    return HardwareProfile(**{**base, **kw})


def _decode(rows: int, ctx: int = 133) -> list[tuple[int, int, bool]]:
    return [(1, ctx, True)] * rows


def test_only_steps_outside_the_graphs_pay_the_eager_term():
    shape = smol_shape()
    plain = CostModel(shape, _cpu(seq_overhead_s=1e-3), "float32")
    graphs = CostModel(shape, _cpu(seq_overhead_s=1e-3, step_graph_max_rows=8,
                                   eager_step_s=EAGER), "float32")
    extra = [graphs.step(w).total_s - plain.step(w).total_s
             for w in (_decode(1), _decode(8), _decode(9), _decode(32), [(256, 256, True)],
                       _decode(3) + [(64, 64, True)], [(1, 500, True), (4, 504, True)])]
    # 1 and 8 decode rows: the graph; 9 and 32 rows, a prefill, a mixed step and a verify row
    # (4 tokens): eager
    assert extra == pytest.approx([0, 0, EAGER, EAGER, EAGER, EAGER, EAGER])
    # compilation.mode=eager: no step runs as a graph
    eager = CostModel(shape, _cpu(seq_overhead_s=1e-3, step_graph_max_rows=8,
                                  eager_step_s=EAGER), "float32", step_graphs=False)
    assert eager.step(_decode(1)).total_s - plain.step(_decode(1)).total_s == \
        pytest.approx(EAGER)
    assert eager.describe()["step_graph_max_rows"] == 0
    # a profile without the term prices every step alike (GPU profiles, older calibrations)
    assert CostModel(shape, _cpu(seq_overhead_s=1e-3, step_graph_max_rows=8), "float32"
                     ).step(_decode(9)).total_s == plain.step(_decode(9)).total_s


def _groups(cm: CostModel) -> list[StepGroup]:
    """The shapes `calibrate engine` times (decodes at batch 1-32 on both sides of the graphs'
    8 rows, prefills, decodes mixed with prompts), priced by ``cm``."""
    groups = [StepGroup(f"prefill {n}", [(n, n, True)], 0.0, 2) for n in (64, 129, 256, 1024)]
    for ctx in (128, 512):
        groups += [StepGroup(f"decode b={b} ctx={ctx}", _decode(b, ctx + 3), 0.0, 5)
                   for b in (1, 4, 16, 32)]
    groups.append(StepGroup("mixed", _decode(8), 0.0, 2))
    groups.append(StepGroup("mixed", _decode(9, 140), 0.0, 2))
    groups.append(StepGroup("mixed", _decode(8) + [(128, 128, True)], 0.0, 2))
    groups.append(StepGroup("mixed", _decode(8, 140) + [(256, 256, True)], 0.0, 2))
    for g in groups:
        g.seconds = cm.step(g.work).total_s
    return groups


def test_engine_fit_recovers_the_eager_term():
    shape = smol_shape()
    truth = _cpu(compute_efficiency=0.4, memory_efficiency=0.6, step_overhead_s=2e-3,
                 layer_overhead_s=1e-4, seq_overhead_s=1.0e-3, token_overhead_s=5e-4,
                 step_graph_max_rows=8, eager_step_s=EAGER)
    groups = _groups(CostModel(shape, truth, "float32"))
    assert is_eager(groups[-4].work, 8) is False and is_eager(groups[-3].work, 8) is True
    fit = fit_engine(shape, "float32", _cpu(), groups, control_plane_s=1e-4, graph_rows=8)
    assert fit.rms_rel_error < 0.01, fit.table()
    assert fit.eager_s == pytest.approx(EAGER, rel=0.1)
    assert fit.profile.step_graph_max_rows == 8
    assert fit.profile.eager_step_s == fit.eager_s
    # without the graphs' rows the linear terms must average the two kinds of step
    blind = fit_engine(shape, "float32", _cpu(), groups, control_plane_s=1e-4)
    assert blind.eager_s == 0 and blind.profile.eager_step_s == 0
    assert blind.rms_rel_error > 3 * fit.rms_rel_error
