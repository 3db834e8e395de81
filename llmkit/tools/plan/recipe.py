"""The recipe ``llmkit plan`` writes: the chosen configuration as a recipe YAML (``recipe=PATH``
loads it; ``llmkit serve MODEL recipe=PATH`` serves it) with, as comments, what it was planned
for and the predicted and measured figures."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from llmkit.tools.plan.space import Candidate

__all__ = ["GOODPUT_TOLERANCE", "agreement_line", "figures_line", "recipe_text",
           "verified_line", "write_recipe"]

# predicted vs measured goodput: the plan says whether they agree within this fraction
GOODPUT_TOLERANCE = 0.20


def figures_line(summary: Mapping[str, Any]) -> str:
    """Goodput, SLO attainment, output throughput and mean TTFT / TPOT of a summary."""
    def mean(key: str) -> str:
        v = (summary.get(key) or {}).get("mean")
        return "-" if v is None else f"{v:.0f} ms"

    att = summary.get("slo_attainment")
    return (f"goodput {summary['goodput']:.3f} req/s, SLO attainment "
            f"{'-' if att is None else f'{100 * att:.0f}%'}, output "
            f"{summary['output_throughput']:.1f} tok/s, mean TTFT {mean('ttft_ms')}, "
            f"mean TPOT {mean('tpot_ms')}")


def agreement_line(predicted: float, measured: float, advice: bool = True) -> str:
    """Predicted vs measured goodput, and whether they agree within the tolerance (``advice``:
    and what to do when they do not)."""
    tol = GOODPUT_TOLERANCE
    if measured > 0:
        err = (predicted - measured) / measured
        ok = abs(err) <= tol
        rel = f"{100 * err:+.0f}%"
    else:
        ok = predicted <= 0
        rel = "measured 0"
    verdict = f"within {100 * tol:.0f}%" if ok else f"NOT within {100 * tol:.0f}%"
    if not ok and advice:
        verdict += (": the simulator's prediction does not hold for this config here "
                    "(recalibrate: llmkit sim calibrate engine)")
    return (f"predicted vs measured goodput: {predicted:.3f} vs {measured:.3f} req/s ({rel}): "
            f"{verdict}")


def recipe_text(cand: Candidate, *, header: Sequence[str] = (),
                objectives: Mapping[str, Any] | None = None) -> str:
    """The recipe: group choices in ``defaults``, then the searched keys (and, for
    ``scheduler=slo``, the ``slo`` section it serves to: ``objectives``)."""
    lines = ["# @package _global_"]
    lines += [f"# {h}" if h else "#" for h in header]
    lines += ["defaults:", f"  - override /scheduler: {cand.scheduler}",
              f"  - override /speculative: {cand.speculative}",
              "scheduler:", f"  max_num_seqs: {cand.max_num_seqs}",
              f"  max_num_batched_tokens: {cand.max_num_batched_tokens}",
              f"  policy: {cand.policy}"]
    if cand.scheduler == "slo":
        lines += [f"  slo_admission: \"{cand.slo_admission}\"", f"  slo_tpot: {cand.slo_tpot}"]
    if cand.speculative != "none":
        lines += ["speculative:", f"  num_speculative_tokens: {cand.num_speculative_tokens}"]
    lines += ["kv_cache:", f"  cache_dtype: {cand.kv_cache_dtype}",
              "model:", f"  quantization: {cand.quantization}",
              "parallel:", f"  tensor_parallel_size: {cand.tensor_parallel_size}",
              f"  pipeline_parallel_size: {cand.pipeline_parallel_size}",
              f"  data_parallel_size: {cand.data_parallel_size}"]
    if cand.scheduler == "slo" and objectives:
        lines += ["slo:"] + [f"  {k}: {'null' if v is None else v}"
                             for k, v in objectives.items()]
    return "\n".join(lines) + "\n"


def verified_line(rank: int, cand: Candidate, predicted: Mapping[str, Any],
                  measured: Mapping[str, Any]) -> str:
    """One verified candidate: its predicted rank and config, predicted vs measured goodput."""
    agreement = agreement_line(predicted["goodput"], measured["goodput"], advice=False)
    return f"verified #{rank} {cand.label()}: {agreement}"


def write_recipe(path: str | Path, cand: Candidate, *, model: str, hardware: str,
                 workload: str, slo: str, predicted: Mapping[str, Any],
                 measured: Mapping[str, Any] | None = None, extra_overrides: Sequence[str] = (),
                 objectives: Mapping[str, Any] | None = None,
                 notes: Sequence[str] = ()) -> Path:
    """Write ``cand`` as a recipe at ``path`` with the figures (and ``notes``: the hardware
    profile's check, the verified candidates) as comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    serve = " ".join(["llmkit serve", model, f"recipe={path}", *extra_overrides])
    header = [f"Written by `llmkit plan` on {when}: {model} on {hardware}.",
              f"Serve it: {serve}", f"workload: {workload}", f"SLO: {slo}",
              f"predicted: {figures_line(predicted)} (the simulator)"]
    if measured is not None:
        header += [f"measured: {figures_line(measured)} (bench serve)",
                   agreement_line(predicted["goodput"], measured["goodput"])]
    else:
        header.append("measured: not verified (plan.verify_top=0, or a model shape)")
    header += list(notes)
    path.write_text(recipe_text(cand, header=header, objectives=objectives))
    return path
