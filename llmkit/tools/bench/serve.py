"""``llmkit bench serve``: build the workload, replay it against the server, summarize.

The server is any OpenAI-compatible one at ``bench.base_url`` (default: llmkit's own at
``server.host:server.port``). MODEL (or ``bench.tokenizer``) only supplies the tokenizer that
random and shared-prefix prompts are drawn from; the served name comes from ``bench.model`` or
the server's ``/v1/models``.
"""
from __future__ import annotations

import datetime
from typing import Any, Mapping

from llmkit.tools.bench.client import ClientOptions, run_load_sync
from llmkit.tools.bench.datasets import WorkloadError, build_workload
from llmkit.tools.bench.metrics import summarize

__all__ = ["load_bench_tokenizer", "run_serve"]


def load_bench_tokenizer(cfg: Any, required: bool = True):
    """``bench.tokenizer`` if set, else the model's (MODEL / ``model.path`` / preset). When not
    ``required`` (a JSONL dataset) a tokenizer that cannot be loaded is ``None``."""
    b = cfg.bench
    try:
        if b.tokenizer:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(b.tokenizer)
        from llmkit.models.loader import resolve_model_source
        return resolve_model_source(cfg.engine.model).load_tokenizer()
    except Exception as e:  # noqa: BLE001 - any loader failure is the same user error
        if required:
            raise WorkloadError(f"cannot load a tokenizer for the workload ({type(e).__name__}: "
                                f"{e}); give MODEL (a model folder or preset) or "
                                "bench.tokenizer=PATH") from None
        return None


def run_serve(cfg: Any, *, sweep: Mapping[str, Any] | None = None,
              tokenizer: Any = None) -> dict[str, Any]:
    """Run ``bench serve`` for ``cfg`` (a ``BenchToolConfig``); returns the result
    document."""
    from llmkit.tools.bench.results import make_result

    b = cfg.bench
    if tokenizer is None:
        need = b.dataset != "jsonl" or b.prompt_format == "text"
        tokenizer = load_bench_tokenizer(cfg, required=need)
    workload = build_workload(b, tokenizer)
    opts = ClientOptions.from_config(cfg)
    load = run_load_sync(workload, opts)
    summary = summarize(load.records, cfg.slo, load.duration_s)
    summary["num_unsent"] = load.num_unsent
    config = {
        "bench": b.model_dump(mode="json"),
        "slo": cfg.slo.model_dump(mode="json"),
        "served_model": load.model,
        "base_url": opts.root,
        "sweep": dict(sweep or {}),
        "started_at": datetime.datetime.fromtimestamp(load.started_at).isoformat(
            timespec="seconds"),
    }
    return make_result(config, summary, load.records, simulated=False, kind="serve")
