"""``llmkit plan``'s table (every candidate in rank order, with the measured figures of those
verified) and plot (goodput against each searched knob, one panel per knob that varied)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from llmkit.tools.plan.runner import Prediction
from llmkit.tools.plan.space import SHORT

__all__ = ["format_table", "plot_plan"]


def _mean(summary: Mapping[str, Any] | None, key: str) -> str:
    v = ((summary or {}).get(key) or {}).get("mean")
    return "-" if v is None else f"{v:.0f}"


def _order(v: Any) -> tuple:
    """Numbers by value, then names."""
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


def format_table(ranked: Sequence[Prediction], knobs: Sequence[str],
                 measured: Mapping[int, Mapping[str, Any]] | None = None,
                 limit: int | None = None) -> str:
    """One row per candidate (``limit``: the first N), best first. ``measured``: ``bench
    serve`` summaries by rank index (0-based)."""
    measured = measured or {}
    knobs = list(knobs) or ["max_num_seqs"]
    head = (["#"] + [SHORT.get(k, k) for k in knobs]
            + ["goodput", "attain", "TTFT ms", "TPOT ms", "tok/s", "tok/core-s", "measured"])
    rows = []
    for i, p in enumerate(ranked[:limit] if limit else ranked):
        vals = p.candidate.values()
        s = p.summary
        if p.error:
            figs = [p.error[:60], "", "", "", "", ""]
        else:
            att = s.get("slo_attainment")
            figs = [f"{p.goodput:.3f}", "-" if att is None else f"{100 * att:.0f}%",
                    _mean(s, "ttft_ms"), _mean(s, "tpot_ms"), f"{s['output_throughput']:.1f}",
                    f"{p.tokens_per_core_s:.1f}"]
        m = measured.get(i)
        rows.append([str(i + 1)] + [str(vals[k]) for k in knobs] + figs
                    + [f"{m['goodput']:.3f}" if m else ""])
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)).rstrip() for r in [head] + rows]
    return "\n".join(lines)


def plot_plan(ranked: Sequence[Prediction], knobs: Sequence[str], png_path: str | Path,
              measured: Mapping[int, Mapping[str, Any]] | None = None) -> Path | None:
    """Goodput (predicted; measured ones marked) against each knob that varied; ``None``
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    measured = measured or {}
    knobs = list(knobs) or ["max_num_seqs"]
    ok = [(i, p) for i, p in enumerate(ranked) if not p.error]
    fig, axes = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.6), squeeze=False)
    for ax, knob in zip(axes[0], knobs):
        values = sorted({p.candidate.values()[knob] for _, p in ok}, key=_order)
        pos = {v: j for j, v in enumerate(values)}
        xs = [pos[p.candidate.values()[knob]] for _, p in ok]
        ax.scatter(xs, [p.goodput for _, p in ok], s=14, alpha=0.6, label="predicted")
        if ok:
            best = ok[0][1]
            ax.scatter([pos[best.candidate.values()[knob]]], [best.goodput], s=60,
                       facecolors="none", edgecolors="red", label="best predicted")
        mx = [(pos[ranked[i].candidate.values()[knob]], m["goodput"]) for i, m in
              measured.items() if not ranked[i].error]
        if mx:
            ax.scatter(*zip(*mx), marker="x", color="black", s=40, label="measured")
        ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlabel(knob)
        ax.set_ylabel("goodput (req/s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("llmkit plan: goodput vs the searched knobs")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
