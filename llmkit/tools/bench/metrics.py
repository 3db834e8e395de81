"""Serving metrics: their written definitions and the pure math (no I/O, no clocks).

Every timestamp is in seconds on one monotonic clock; every latency is reported in ms.

For one request (the seed's ch. 02):

- **arrival** — the moment the request is issued to the server (the client sends it). Time
  spent waiting in the *server's* queue, tokenizing and prefilling is after arrival, so it is
  part of TTFT. (A client-side concurrency cap delays the send itself; that wait is reported
  separately as ``queue_ms`` and is not part of TTFT, as in vLLM's benchmark.)
- **TTFT** (time to first token) = first token's time − arrival. Includes queueing. (From
  the client, a token's time is when the streamed chunk that carries it arrives: its text, or
  the choice's finish for tokens without text of their own.)
- **E2E latency** (``e2el``) = end − arrival, where end is when the last token (the end of the
  response stream) arrived.
- **TPOT** (time per output token) = (E2E − TTFT) / (output tokens − 1): the mean gap between
  output tokens after the first. Undefined (``None``) for a request with one output token; such
  a request meets any TPOT objective.
- **ITL** (inter-token latency) = one entry per output token after the first
  (``output tokens − 1`` entries): a chunk that carries k tokens contributes k entries of its
  gap to the previous chunk divided by k (the gap split evenly over its tokens, as SGLang's
  benchmark does), and the tokens that came with the first token add entries of 0. So ITL
  percentiles are over tokens, and a request's mean ITL is (last chunk − first chunk) /
  (output tokens − 1). The tokens of each chunk are the server's count (the growth of
  ``usage.completion_tokens`` under ``stream_options.continuous_usage_stats``); where the
  server gives no count per chunk, each chunk counts one token and the rest of the reported
  total is put on the last chunk. Summaries pool all entries of all requests.
- A request is **ok** when the server answered 200 and streamed at least one token.

For a run (``summarize``):

- ``duration_s`` — from the first request's arrival to the last response's end (or the time
  limit), as the caller measured it.
- **request throughput** = completed requests / duration; **output throughput** = output tokens
  of completed requests / duration; **total token throughput** adds their prompt tokens.
- **goodput** = requests / s that completed *and* met every SLO that is set
  (TTFT ≤ ``slo.ttft_ms`` ∧ TPOT ≤ ``slo.tpot_ms`` ∧ E2E ≤ ``slo.e2el_ms``), over the same
  duration. With no SLO set, goodput equals request throughput.
- **SLO attainment** (``slo_attainment``: per metric ``ttft``, ``tpot``, ``e2el`` and ``all``)
  = the fraction of all requests sent (failed ones miss) that completed and met that
  objective (``all``: every objective that is set; the same as ``slo_attainment_all``, which
  goodput counts); ``None`` for a metric without an objective.
- Percentiles interpolate linearly between order statistics (numpy's default), over completed
  requests only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["METRICS", "PERCENTILES", "RequestRecord", "Slo", "meets_objective", "meets_slo",
           "percentile",
           "request_record", "stats", "summarize"]

# The metrics the summary reports, each as {mean, p50, p90, p99}.
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Slo:
    """Service-level objectives in ms; ``None`` = no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def of(cls, obj: Any) -> "Slo":
        """From a ``SloConfig``, a mapping, an ``Slo`` or ``None``."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            return cls(**{k: obj.get(k) for k in ("ttft_ms", "tpot_ms", "e2el_ms")})
        return cls(obj.ttft_ms, obj.tpot_ms, obj.e2el_ms)


@dataclass(slots=True)
class RequestRecord:
    """One request as the result file stores it (API.md's fields first, then extras)."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None
    itl_ms: list[float]
    prompt_tokens: int | None
    output_tokens: int
    ok: bool
    # -- extras: enough to redraw throughput over time and to debug ---------------------
    request_id: str = ""
    # when the request was sent, seconds after the benchmark started
    start_s: float | None = None
    # client-side wait before sending (concurrency cap / a late event loop), ms
    queue_ms: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RequestRecord":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def request_record(arrival_s: float, chunk_times_s: Sequence[float], end_s: float | None = None,
                   *, output_tokens: int | None = None, chunk_tokens: Sequence[int] | None = None,
                   prompt_tokens: int | None = None, ok: bool = True, error: str | None = None,
                   request_id: str = "", start_s: float | None = None,
                   queue_ms: float = 0.0) -> RequestRecord:
    """Metrics of one request from its timestamps (seconds, one clock).

    ``chunk_times_s``: when each streamed chunk with output arrived; ``chunk_tokens``: how many
    tokens each carried (default: one each); ``end_s``: when the response ended (default: the
    last chunk); ``output_tokens``: the count the server reported (default: the chunks'
    tokens). A request without any chunk is not ok.
    """
    times = list(chunk_times_s)
    counts = [1] * len(times) if chunk_tokens is None else [int(k) for k in chunk_tokens]
    if len(counts) != len(times):
        raise ValueError("chunk_tokens needs one count per chunk")
    if chunk_tokens is not None and ok:
        # a chunk without a token of its own (a finish that came alone) has no token time
        times = [t for t, k in zip(times, counts) if k > 0]
        counts = [k for k in counts if k > 0]
    if not times or not ok:
        return RequestRecord(None, None, None, [], prompt_tokens, output_tokens or 0, False,
                             request_id, start_s, queue_ms, error or "no tokens received")
    if any(b < a for a, b in zip(times, times[1:])) or times[0] < arrival_s:
        raise ValueError("chunk times must be non-decreasing and not before the arrival")
    end = times[-1] if end_s is None else max(end_s, times[-1])
    n_out = sum(counts) if output_tokens is None else int(output_tokens)
    ttft = times[0] - arrival_s
    e2el = end - arrival_s
    tpot = (e2el - ttft) / (n_out - 1) if n_out > 1 else None
    itl = _itl_per_token(times, _reconcile(counts, n_out))
    return RequestRecord(1e3 * ttft, None if tpot is None else 1e3 * tpot, 1e3 * e2el, itl,
                         prompt_tokens, n_out, True, request_id, start_s, queue_ms, error)


def _reconcile(counts: list[int], n_out: int) -> list[int]:
    """Per-chunk token counts that add up to the reported total: tokens no chunk announced go
    to the last chunk; counts beyond the total are taken off the last chunks (keeping one
    token per chunk while the total allows)."""
    counts = list(counts)
    extra = n_out - sum(counts)
    if extra > 0:
        counts[-1] += extra
    i = len(counts) - 1
    while extra < 0 and i >= 0:
        take = min(-extra, counts[i] - (1 if i < n_out else 0))
        counts[i] -= take
        extra += take
        i -= 1
    return counts


def _itl_per_token(times: list[float], counts: list[int]) -> list[float]:
    """One ITL (ms) per token after the first: a chunk's gap split evenly over its tokens;
    tokens that arrived with the first token have a gap of 0."""
    itl = [0.0] * max(counts[0] - 1, 0) if counts else []
    prev = times[0]
    for t, k in zip(times[1:], counts[1:]):
        if k > 0:
            itl.extend([1e3 * (t - prev) / k] * k)
            prev = t
    return itl


def meets_slo(rec: RequestRecord | Mapping[str, Any], slo: Slo) -> bool:
    """A completed request that meets every objective that is set (TPOT: a one-token request
    has none and meets it)."""
    get = rec.get if isinstance(rec, Mapping) else (lambda k: getattr(rec, k))
    if not get("ok"):
        return False
    for key, limit in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms),
                       ("e2el_ms", slo.e2el_ms)):
        value = get(key)
        if limit is None or (value is None and key == "tpot_ms"):
            continue
        if value is None or value > limit:
            return False
    return True


def meets_objective(rec: RequestRecord, key: str, limit: float | None) -> bool:
    """A completed request within one objective (``key``: ttft_ms, tpot_ms, e2el_ms; a
    one-token request has no TPOT and meets it)."""
    if not rec.ok:
        return False
    value = getattr(rec, key)
    if limit is None or (value is None and key == "tpot_ms"):
        return True
    return value is not None and value <= limit


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method);
    ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Iterable[float | None]) -> dict[str, float | None]:
    """``{mean, p50, p90, p99}`` of the values that are not ``None`` (all ``None`` if none)."""
    xs = [float(v) for v in values if v is not None]
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    return out


def _as_record(r: RequestRecord | Mapping[str, Any]) -> RequestRecord:
    return r if isinstance(r, RequestRecord) else RequestRecord.from_dict(r)


def summarize(records: Sequence[RequestRecord | Mapping[str, Any]], slo: Any = None,
              duration_s: float = 0.0) -> dict[str, Any]:
    """The run's summary (API.md's keys, then extras). Pure: the same records, SLOs and
    duration always give the same summary."""
    recs = [_as_record(r) for r in records]
    slo = Slo.of(slo)
    done = [r for r in recs if r.ok]
    good = [r for r in done if meets_slo(r, slo)]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "num_requests": len(recs),
        "completed": len(done),
        "failed": len(recs) - len(done),
        "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "goodput": per_s(len(good)),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "good_requests": len(good),
        "slo_attainment": len(good) / len(recs) if recs else None,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms},
    }
    n = len(recs)
    summary["slo_attainment_by_metric"] = {
        key[:-3]: (sum(meets_objective(r, key, limit) for r in recs) / n if n else None)
        if limit is not None else None
        for key, limit in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms),
                           ("e2el_ms", slo.e2el_ms))}
    summary["slo_attainment_by_metric"]["all"] = summary["slo_attainment"]
    summary["ttft_ms"] = stats(r.ttft_ms for r in done)
    summary["tpot_ms"] = stats(r.tpot_ms for r in done)
    summary["itl_ms"] = stats(x for r in done for x in r.itl_ms)
    summary["e2el_ms"] = stats(r.e2el_ms for r in done)
    return summary

