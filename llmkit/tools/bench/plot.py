"""``llmkit bench plot DIR``: the results of a sweep, drawn against the swept value.

Reads every ``*.json`` result in DIR. Each result's ``config.sweep`` names the values it was run
with (``-m bench.rate=1,2,4``); the first swept key is the x axis, any other swept keys make one
line per combination. Serve (and simulated) results show goodput and request throughput, SLO
attainment per objective (TTFT, TPOT, E2EL and all), p99 TTFT and p99 TPOT (with their SLOs)
and output throughput; throughput results show output
throughput (and the ratio to the baseline when there is one); latency results show the batch
latency. Writes ``DIR/sweep.png`` (or ``out``) and returns the table it printed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["collect", "plot_sweep", "sweep_table"]


def collect(directory: str | Path) -> list[dict[str, Any]]:
    """The result documents in ``directory`` (files that are not results are skipped)."""
    out = []
    for path in sorted(Path(directory).expanduser().glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and "summary" in doc and "config" in doc:
            doc["_path"] = str(path)
            out.append(doc)
    return out


def _kind(doc: Mapping[str, Any]) -> str:
    return doc.get("kind") or ("serve" if "goodput" in doc.get("summary", {}) else "throughput")


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _swept_keys(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: list[str] = []
    for d in docs:
        for k in (d.get("config", {}).get("sweep") or {}):
            if k not in keys:
                keys.append(k)
    return keys


def _x_of(doc: Mapping[str, Any], key: str | None) -> Any:
    if key is None:
        return Path(doc.get("_path", "?")).stem
    return (doc.get("config", {}).get("sweep") or {}).get(key)


def _series(docs: Sequence[Mapping[str, Any]], keys: list[str]
            ) -> dict[str, list[Mapping[str, Any]]]:
    rest = keys[1:]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for d in docs:
        sweep = d.get("config", {}).get("sweep") or {}
        label = ", ".join(f"{k}={sweep.get(k)}" for k in rest) or "_"
        groups.setdefault(label, []).append(d)
    return groups


Getter = Callable[[Mapping[str, Any], Mapping[str, Any]], Any]


def _attainment(key: str) -> Getter:
    """Percent of requests meeting objective ``key`` (None where it has none, or a result
    written before attainment was counted per metric)."""
    def get(s: Mapping[str, Any], d: Mapping[str, Any]) -> float | None:
        v = (s.get("slo_attainment_by_metric") or {}).get(key)
        return None if v is None else 100.0 * v
    return get


def _panels(kind: str) -> list[tuple[str, str, list[tuple[str, Getter]]]]:
    """(panel title, unit, [(series name, getter(summary, doc))]) per panel."""
    if kind == "throughput":
        return [("output throughput", "tok/s",
                 [("llmkit", lambda s, d: s.get("output_throughput")),
                  ("baseline", lambda s, d: (d.get("baseline") or {}).get("output_throughput"))]),
                ("ratio to baseline (output tok/s)", "x",
                 [("llmkit / baseline", lambda s, d: (d.get("ratio") or {}).get(
                     "output_throughput"))]),
                ("request throughput", "req/s",
                 [("llmkit", lambda s, d: s.get("request_throughput"))])]
    if kind == "latency":
        return [("batch latency", "s",
                 [("mean", lambda s, d: (s.get("latency_s") or {}).get("mean"))]),
                ("step time (p50)", "ms",
                 [("decode", lambda s, d: (s.get("decode_step_ms") or {}).get("p50")),
                  ("prefill", lambda s, d: (s.get("prefill_step_ms") or {}).get("p50"))])]
    return [("goodput and request throughput", "req/s",
             [("goodput", lambda s, d: s.get("goodput")),
              ("throughput", lambda s, d: s.get("request_throughput"))]),
            ("SLO attainment (of requests sent)", "%",
             [(name, _attainment(key)) for key, name in (
                 ("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"), ("all", "all"))]),
            ("p99 TTFT", "ms", [("p99 TTFT", lambda s, d: (s.get("ttft_ms") or {}).get("p99"))]),
            ("p99 TPOT", "ms", [("p99 TPOT", lambda s, d: (s.get("tpot_ms") or {}).get("p99"))]),
            ("output throughput", "tok/s",
             [("output", lambda s, d: s.get("output_throughput"))])]


def sweep_table(docs: Sequence[Mapping[str, Any]]) -> str:
    if not docs:
        return "(no results)"
    keys = _swept_keys(docs)
    cols = [(f"{name} ({unit})", get) for _, unit, series in _panels(_kind(docs[0]))
            for name, get in series]
    head = ["point"] + [c for c, _ in cols]
    rows = []
    for d in _sorted(docs, keys[0] if keys else None):
        sweep = d.get("config", {}).get("sweep") or {}
        point = ", ".join(f"{k}={v}" for k, v in sweep.items()) or Path(d["_path"]).stem
        vals = [g(d.get("summary", {}), d) for _, g in cols]
        rows.append([point] + ["-" if v is None else f"{v:.2f}" for v in vals])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [head] + rows)


def _sorted(docs: Sequence[Mapping[str, Any]], key: str | None) -> list[Mapping[str, Any]]:
    def k(d: Mapping[str, Any]):
        x = _x_of(d, key)
        n = _num(x)
        return (0, n, "") if n is not None else (1, 0.0, str(x))
    return sorted(docs, key=k)


def plot_sweep(directory: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    """Draw the sweep in ``directory``; returns (the PNG's path, the table)."""
    from llmkit.tools.bench.results import _pyplot

    docs = collect(directory)
    if not docs:
        raise FileNotFoundError(f"no benchmark results (*.json) in {directory}")
    plt = _pyplot()
    keys = _swept_keys(docs)
    xkey = keys[0] if keys else None
    kind = _kind(docs[0])
    docs = [d for d in docs if _kind(d) == kind]
    panels = _panels(kind)
    xs_all = [_x_of(d, xkey) for d in docs]
    numeric = all(_num(x) is not None and math.isfinite(_num(x)) for x in xs_all)
    cats = [] if numeric else sorted({str(x) for x in xs_all},
                                     key=lambda s: (_num(s) is None, _num(s) or 0.0, s))
    ncols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    slo = (docs[0].get("summary", {}).get("slo") or docs[0].get("config", {}).get("slo") or {})
    groups = _series(docs, keys)
    for ax, (title, unit, series) in zip(flat, panels):
        for glabel, group in groups.items():
            group = _sorted(group, xkey)
            xs = [_num(_x_of(d, xkey)) if numeric else cats.index(str(_x_of(d, xkey)))
                  for d in group]
            for name, get in series:
                ys = [get(d.get("summary", {}), d) for d in group]
                pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if not pts:
                    continue
                label = " ".join(p for p in (name if len(series) > 1 else "",
                                             "" if glabel == "_" else glabel) if p)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=label or None)
        limit = {"p99 TTFT": slo.get("ttft_ms"), "p99 TPOT": slo.get("tpot_ms")}.get(title)
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        if not numeric:
            ax.set_xticks(range(len(cats)), cats)
        ax.set_xlabel(xkey or "result")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"bench {kind} sweep: {Path(directory).name} ({len(docs)} points)",
                 fontsize=10)
    fig.tight_layout()
    path = Path(out) if out else Path(directory).expanduser() / "sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, sweep_table(docs)
