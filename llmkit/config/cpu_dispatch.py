"""The CPU platform's dispatch table: every per-step fast-path choice, in one place per machine.

Each CPU component picks between kernels by a row count (the C++ small-batch linear or
oneDNN's GEMM, the LoRA kernel or torch's GEMMs, ...). The crossovers depend on the machine,
so they are data: defaults per instruction-set tier (``llmkit.config.cpu_isa``), overridable
by ``platform.dispatch.<field>``, resolved once by the platform and handed to the components
it builds. ``llmkit config`` prints the resolved table.

Rule: a choice that is timed at start-up must never change outputs. The paths that the row
counts (``linear_*_max_rows``, ``lora_*``, ``attention_*``) and ``top_p_candidates`` choose
between compute different bits for a row (another kernel, another summation order), so those
are fixed per tier, never timed. Step graphs compute the eager step's bits, but timing their
row count means compiling graphs (minutes on a CPU), so it is fixed too (a ceiling, lowered
per model by a fixed rule: the rows its linear layers keep one kernel). The fields in
``CALIBRATED`` change speed only: the C++ linears' prefetch distance (prefetches only warm the
cache) and the least weight bytes one of their threads streams (each output is one thread's
fixed chain of sums, however many threads share the weight: ``kernels/cpu/tuning.h``). Those
the platform times on the real kernels at first start, a few seconds, and caches with the
kernel build keyed by the CPU's model, flags and threads (``llmkit.kernels.cpu_calibration``;
``platform.calibrate``); tests check that every candidate computes the same bits. The torch
thread count (``platform.num_threads``) is given, never timed: oneDNN's and MKL's GEMMs may
split their sums by thread.

Each field's source is one of ``SOURCES``: the tier's default, the calibration, or given in
``platform.dispatch`` (which always wins).

Lives in ``llmkit.config`` (below every layer) because the linear methods, the LoRA ops, the
attention backend and the sampler take it in their constructors without seeing the platform.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from llmkit.config.cpu_isa import TIER_NAMES
from llmkit.config.errors import ConfigError

__all__ = ["CALIBRATED", "CpuDispatch", "DISPATCH_KEY", "SOURCES", "TIER_DEFAULTS",
           "dispatch_for_tier", "dispatch_sources", "describe_dispatch", "describe_graph_rows",
           "resolve_dispatch"]

DISPATCH_KEY = "platform.dispatch"


@dataclass(frozen=True, slots=True)
class CpuDispatch:
    """The choices, by the component that reads them. The values below are the defaults of
    every tier; the measurements behind them are in docs/cpu-speed.md ("The dispatch table")."""

    #: Rows up to which ``CpuLinearMethod`` runs llmkit's C++ small-batch linear (it streams
    #: the weight once in its dtype; above, the packed GEMM's reuse wins). 0: never.
    linear_small_batch_max_rows: int = 8
    #: Rows up to which ``CpuLinearMethod`` uses the oneDNN-packed weight (MKL on the plain one
    #: above). 0: never.
    linear_packed_max_rows: int = 512
    #: Rows up to which ``CpuLoRAOps`` runs the C++ ``lora_add_`` (``benchmarks/
    #: test_lora_ops_bench.py`` times it against torch's GEMMs). 0: never.
    lora_small_batch_max_rows: int = 2048
    #: Without the C++ kernels: decode rows from which ``CpuAttentionBackend`` runs its compiled
    #: paged kernel (below, gather + SDPA is a little faster: the gather fits in cache).
    attention_min_compiled_decode_rows: int = 8
    #: With the C++ kernels: rows of at most this many query tokens (speculative verification,
    #: small chunks) run as one decode row per token. 1: none.
    attention_max_expanded_query_len: int = 16
    #: Decode steps of up to this many rows (and ``scheduler.max_num_seqs``) become step
    #: graphs (``compilation.mode=graphs``), as far as every linear layer of the loaded model
    #: keeps one kernel (``CpuPlatform.graph_rows``): quantized layers at any row count, float
    #: and bf16 layers up to ``linear_small_batch_max_rows`` (the C++ linear; oneDNN above),
    #: the ``amx`` tier's bf16 tiles up to ``linear_packed_max_rows``. Graphs compute the eager
    #: step's bits; one graph is dynamic in the rows, so more rows compile no more graphs.
    step_graph_max_rows: int = 256
    #: Top-p looks for its cut among this many most likely tokens before sorting a whole row
    #: (a full sort of a large vocabulary costs far more than a top-k of a few hundred).
    top_p_candidates: int = 256
    #: CPU ranks allowed per usable core (tensor / pipeline parallel): tiny models in tests run
    #: TP=2 x PP=2 on two cores; more would only thrash.
    ranks_per_core: int = 2
    #: Bytes ahead of the block being read at which llmkit's C++ bf16 and quantized linears
    #: prefetch the weight (0: no software prefetch). Speed only: calibrated.
    linear_prefetch_bytes: int = 2048
    #: The least weight bytes one thread of llmkit's C++ linears streams: a smaller weight
    #: runs on fewer threads, which saves waking them (0: every thread, always). Speed only:
    #: calibrated.
    linear_thread_min_bytes: int = 8192
    #: Microseconds an idle thread of the C++ kernels' own pool keeps spinning, yielding its
    #: core to any other runnable thread, before it sleeps (``kernels/cpu/thread_pool.h``):
    #: the next kernel of a step finds it awake without taking the core from another process.
    #: 0: the kernels run on torch's OpenMP threads instead. Speed only; a wait policy, not
    #: timed (a quiet start-up would always pick the longest spin).
    thread_pool_spin_us: int = 2000


#: The defaults of each tier (``None``: a CPU without AVX2, so without llmkit's kernels). Every
#: tier has today's measured values until a machine of that tier is measured.
TIER_DEFAULTS: dict[str | None, CpuDispatch] = {
    name: CpuDispatch() for name in (*TIER_NAMES, None)}

#: The smallest value each field takes (what ``platform.dispatch`` validates against).
MINIMUMS: dict[str, int] = {
    "linear_small_batch_max_rows": 0, "linear_packed_max_rows": 0,
    "lora_small_batch_max_rows": 0, "attention_min_compiled_decode_rows": 1,
    "attention_max_expanded_query_len": 1, "step_graph_max_rows": 1, "top_p_candidates": 1,
    "ranks_per_core": 1, "linear_prefetch_bytes": 0, "linear_thread_min_bytes": 0,
    "thread_pool_spin_us": 0}

#: The fields a start-up timing may set: every value of each computes the same bits.
CALIBRATED: tuple[str, ...] = ("linear_prefetch_bytes", "linear_thread_min_bytes")

#: Where a resolved field's value came from.
SOURCES = ("tier", "calibrated", "given")


def dispatch_for_tier(tier: str | None) -> CpuDispatch:
    """The defaults of ``tier`` (a ``cpu_isa.TIER_NAMES`` name, or None: no AVX2)."""
    return TIER_DEFAULTS[tier]


def resolve_dispatch(tier: str | None, overrides: Any = None,
                     calibrated: dict[str, int] | None = None) -> CpuDispatch:
    """The tier's table with ``calibrated`` (timed values of ``CALIBRATED`` fields) and then
    ``overrides`` (``platform.dispatch``: an object or mapping whose non-null fields replace
    the rest). Raises ``ConfigError`` naming the key for a value out of range."""
    base = dispatch_for_tier(tier)
    given = _given(overrides)
    timed = dict(calibrated or {})
    if not set(timed) <= set(CALIBRATED):  # a row count would change outputs
        raise ValueError(f"only {CALIBRATED} are timed, not "
                         f"{sorted(set(timed) - set(CALIBRATED))}")
    table = replace(base, **{**timed, **given})
    for name, value in given.items():
        low = MINIMUMS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{DISPATCH_KEY}.{name}", value, f"an integer >= {low} or null")
    return table


def dispatch_sources(overrides: Any = None, calibrated: dict[str, int] | None = None
                     ) -> dict[str, str]:
    """Each field's source (``SOURCES``) in the table ``resolve_dispatch`` builds from the
    same arguments."""
    given, timed = _given(overrides), calibrated or {}
    return {f.name: "given" if f.name in given else "calibrated" if f.name in timed else "tier"
            for f in fields(CpuDispatch)}


def describe_dispatch(table: CpuDispatch, sources: dict[str, str] | None = None) -> str:
    """``name=value`` pairs in field order, for ``llmkit config`` and start-up logs; with
    ``sources``, grouped by source (``tier: ... | calibrated: ... | given: ...``)."""
    pairs = {f.name: f"{f.name}={getattr(table, f.name)}" for f in fields(table)}
    if sources is None:
        return " ".join(pairs.values())
    groups = [f"{source}: " + " ".join(pairs[n] for n in pairs if sources[n] == source)
              for source in SOURCES if source in sources.values()]
    return " | ".join(groups)


def describe_graph_rows(table: CpuDispatch, tier: str | None, max_num_seqs: int) -> str:
    """The decode rows step graphs cover by the kind of model (``CpuPlatform.graph_rows``'s
    rule), for ``llmkit config``: which rows run eagerly is part of what the table means."""
    ceiling = max(1, min(table.step_graph_max_rows, max_num_seqs))
    float_rows = max(1, min(ceiling, table.linear_small_batch_max_rows))
    bf16 = (f"; bf16 on the amx tiles {max(1, min(ceiling, table.linear_packed_max_rows))}"
            if tier == "amx" else "")
    return (f"step graphs cover decode steps of up to: quantized linears {ceiling} "
            f"(step_graph_max_rows, scheduler.max_num_seqs); float/bf16 linears {float_rows} "
            f"(linear_small_batch_max_rows){bf16}")


def _given(overrides: Any) -> dict[str, int]:
    if overrides is None:
        return {}
    items = overrides.items() if isinstance(overrides, dict) else (
        (f.name, getattr(overrides, f.name, None)) for f in fields(CpuDispatch))
    names = {f.name for f in fields(CpuDispatch)}
    given = {}
    for name, value in items:
        if name not in names:
            raise ConfigError(f"{DISPATCH_KEY}.{name}", value, "a key of platform.dispatch: "
                              + ", ".join(sorted(names)))
        if value is not None:
            given[name] = value
    return given
