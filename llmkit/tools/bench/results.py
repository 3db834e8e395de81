"""Benchmark result files: JSON (API.md's shape) with a PNG figure of the same stem beside it,
and the terminal table.

    {"config": {...}, "simulated": bool, "summary": {...}, "requests": [...]}

``bench serve`` and the simulator both write through ``make_result`` + ``write_result``: the
simulator passes ``simulated=True`` and records built with ``metrics.request_record`` on its
virtual clock (set ``start_s`` on each record to get the throughput-over-time panel).
Non-finite floats become JSON-safe (``inf`` → ``"inf"``, ``nan`` → ``null``).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

from llmkit.tools.bench.metrics import METRICS, RequestRecord

__all__ = ["format_summary", "jsonable", "load_result", "make_result", "plot_serve_result",
           "print_summary", "result_stem", "write_json", "write_result"]


def jsonable(obj: Any) -> Any:
    """Plain JSON data: dataclass records as dicts, inf as ``"inf"``, nan as ``None``."""
    if isinstance(obj, RequestRecord):
        return jsonable(obj.to_dict())
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def make_result(config: Mapping[str, Any], summary: Mapping[str, Any],
                records: Sequence[RequestRecord | Mapping[str, Any]], *,
                simulated: bool = False, **extra: Any) -> dict[str, Any]:
    """The result document; ``extra`` keys (e.g. ``kind``, ``baseline``) go after the four
    contract keys."""
    result = {"config": dict(config), "simulated": bool(simulated), "summary": dict(summary),
              "requests": list(records)}
    result.update(extra)
    return jsonable(result)


def result_stem(kind: str, sweep: Mapping[str, Any] | None = None,
                name: str | None = None) -> str:
    """``name``; else ``<kind>-<key>=<value>_...`` for a sweep point; else ``<kind>-<time>``."""
    if name:
        return name
    if sweep:
        parts = [f"{k}={_plain_value(v)}" for k, v in sweep.items()]
        return f"{kind}-" + "_".join(parts).replace("/", "-").replace(" ", "")
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _plain_value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def write_json(result: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=2) + "\n")
    return path


def write_result(result: Mapping[str, Any], output_dir: str | Path, stem: str, *,
                 figure: bool = True) -> tuple[Path, Path | None]:
    """Write ``<output_dir>/<stem>.json`` and (serve-shaped results) ``<stem>.png``."""
    out = Path(output_dir).expanduser()
    json_path = write_json(result, out / f"{stem}.json")
    png_path = None
    if figure:
        png_path = out / f"{stem}.png"
        plot_serve_result(result, png_path)
    return json_path, png_path


def load_result(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- the figure

def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def _token_events(records: Iterable[Mapping[str, Any]]
                  ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """((time, tokens) per streamed chunk, (start, end) per request) from completed records
    that have ``start_s``. A chunk's tokens are the request's output tokens spread evenly over
    its chunks."""
    chunks: list[tuple[float, float]] = []
    spans: list[tuple[float, float]] = []
    for r in records:
        if not r.get("ok") or r.get("start_s") is None or r.get("ttft_ms") is None:
            continue
        itl = r.get("itl_ms") or []
        per_chunk = r.get("output_tokens", 0) / (len(itl) + 1)
        t = r["start_s"] + r["ttft_ms"] / 1e3
        chunks.append((t, per_chunk))
        for gap in itl:
            t += gap / 1e3
            chunks.append((t, per_chunk))
        spans.append((r["start_s"], r["start_s"] + r["e2el_ms"] / 1e3))
    return chunks, spans


def plot_serve_result(result: Mapping[str, Any], png_path: str | Path) -> Path:
    """Latency CDFs (TTFT; TPOT and ITL; E2E, with the SLOs as dashed lines) and throughput
    over time (output tokens/s and completed requests/s per time bin)."""
    plt = _pyplot()
    records = [r for r in result.get("requests", []) if isinstance(r, Mapping)]
    done = [r for r in records if r.get("ok")]
    summary = result.get("summary", {})
    slo = summary.get("slo") or (result.get("config", {}) or {}).get("slo") or {}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0][0], "TTFT (ms)", [("TTFT", [r["ttft_ms"] for r in done])], slo.get("ttft_ms")),
        (axes[0][1], "TPOT / ITL (ms)",
         [("TPOT", [r["tpot_ms"] for r in done if r.get("tpot_ms") is not None]),
          ("ITL", [x for r in done for x in r.get("itl_ms") or []])], slo.get("tpot_ms")),
        (axes[1][0], "E2E latency (ms)", [("E2E", [r["e2el_ms"] for r in done])],
         slo.get("e2el_ms")),
    ]
    for ax, xlabel, series, limit in panels:
        for label, values in series:
            _cdf(ax, values, label)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", transform=ax.transAxes)
    _throughput_panel(axes[1][1], records, summary)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _throughput_panel(ax, records: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]
                      ) -> None:
    """Output tokens/s per time bin, and requests in flight (a step line) on a second axis."""
    chunks, spans = _token_events(records)
    ax.set_xlabel("time since start (s)")
    if not chunks:
        ax.text(0.5, 0.5, "no completed requests with start times", ha="center",
                transform=ax.transAxes)
        return
    horizon = max(max(t for t, _ in chunks), max(e for _, e in spans))
    width = max(horizon / 40, 0.1)
    nbins = max(1, math.ceil(horizon / width))
    tok = [0.0] * nbins
    for t, n in chunks:
        tok[min(int(t / width), nbins - 1)] += n
    xs = [(i + 0.5) * width for i in range(nbins)]
    ax.plot(xs, [v / width for v in tok], color="tab:blue", marker=".")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    ts, inflight, n = [0.0], [0], 0
    for t, d in events:
        n += d
        ts.append(t)
        inflight.append(n)
    ax2 = ax.twinx()
    ax2.step(ts, inflight, where="post", color="tab:orange", alpha=0.8)
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"throughput over time (bins of {width:.2f} s)", fontsize=9)


def _title(result: Mapping[str, Any]) -> str:
    cfg = result.get("config", {}) or {}
    bench = cfg.get("bench", {}) or {}
    s = result.get("summary", {}) or {}
    sim = " (simulated)" if result.get("simulated") else ""
    head = (f"{cfg.get('served_model') or bench.get('model') or ''}{sim} — dataset "
            f"{bench.get('dataset', '?')}, rate {bench.get('rate', '?')} req/s "
            f"({bench.get('arrival', '?')}), {s.get('num_requests', '?')} requests")
    tail = (f"throughput {s.get('request_throughput', 0):.2f} req/s, "
            f"{s.get('output_throughput', 0):.1f} tok/s; goodput {s.get('goodput', 0):.2f} "
            "req/s")
    return head + "\n" + tail


# --------------------------------------------------------------------------- the table

def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_summary(summary: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """vLLM-style table of a serve summary."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<34}{_fmt(value):>16}")

    row("Successful requests:", summary.get("completed"))
    row("Failed requests:", summary.get("failed"))
    row("Benchmark duration (s):", summary.get("duration_s"))
    row("Total input tokens:", summary.get("total_input_tokens"))
    row("Total generated tokens:", summary.get("total_output_tokens"))
    row("Request throughput (req/s):", summary.get("request_throughput"))
    row("Output token throughput (tok/s):", summary.get("output_throughput"))
    row("Total token throughput (tok/s):", summary.get("total_token_throughput"))
    slo = {k: v for k, v in (summary.get("slo") or {}).items() if v is not None}
    slo_text = ", ".join(f"{k[:-3]}<={v:g}ms" for k, v in slo.items()) or "none"
    row("Goodput (req/s):", summary.get("goodput"))
    lines.append(f"  SLOs: {slo_text}")
    att = summary.get("slo_attainment_by_metric") or {}
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"), ("all", "all")):
        if key in att and (key == "all" and slo or att[key] is not None):
            row(f"SLO attainment, {label} (%):", None if att[key] is None
                else 100.0 * att[key])
    names = {"ttft_ms": "Time to First Token", "tpot_ms": "Time per Output Token (excl. 1st)",
             "itl_ms": "Inter-token Latency", "e2el_ms": "End-to-end Latency"}
    for m in METRICS:
        st = summary.get(m) or {}
        lines.append(f"{' ' + names[m] + ' ':-^{w}}")
        for k in ("mean", "p50", "p90", "p99"):
            row(f"{k.capitalize() if k == 'mean' else k.upper()} {m[:-3].upper()} (ms):",
                st.get(k))
    lines.append("=" * w)
    return "\n".join(lines)


def print_summary(summary: Mapping[str, Any], file: TextIO | None = None) -> None:
    print(format_summary(summary), file=file or sys.stdout)
