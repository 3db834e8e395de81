"""Prometheus metrics of the OpenAI server (``GET /metrics``), with vLLM's names where vLLM
has the metric (prefix ``llmkit:``). Every series carries the label ``model_name``.

Per request (an "engine request": each of a request's ``n`` samples counts as one):

- ``llmkit:time_to_first_token_seconds`` (histogram): from the request's arrival in the API
  process (after validation) to its first generated token arriving back there — tokenization,
  queueing, prefill and transport included.
- ``llmkit:inter_token_latency_seconds`` (histogram): time between consecutive output tokens of
  a request, as this process receives them (one observation per token after the first).
- ``llmkit:e2e_request_latency_seconds`` (histogram): arrival to the final output.
- ``llmkit:request_queue_time_seconds`` (histogram): engine-side, from the request's arrival in
  the engine core to its first scheduling (requests that finish without ever being scheduled,
  e.g. aborted while waiting, are not observed).
- ``llmkit:prompt_tokens_total`` / ``llmkit:generation_tokens_total`` (counters): prompt tokens
  of requests that produced a first token; tokens generated and delivered.
- ``llmkit:request_success_total{finished_reason}`` (counter): finished requests by reason:
  ``stop``, ``length``, ``abort`` (client gone, or shutdown), ``error`` (the engine refused it
  or died).

Engine state, from the engine core's stats snapshot after its latest step or abort:

- ``llmkit:num_requests_running`` / ``llmkit:num_requests_waiting`` (gauges): requests in the
  scheduler's running list / waiting queue (preempted ones wait).
- ``llmkit:kv_cache_usage_perc`` (gauge, 0..1): fraction of KV blocks held by requests or
  pinned; freed blocks that still cache a prefix count as free.
- ``llmkit:kv_cache_group_usage_perc{group}`` (gauge, 0..1): per KV-cache group (``group`` is
  ``"<index>:<spec>"``, e.g. ``0:full``, ``1:sliding_window(4096)``, ``0:mla``), the fraction of
  the pool's blocks its requests hold. A model with one group has one series equal to
  ``kv_cache_usage_perc`` (less pinned blocks); a hybrid model one per group (a separate name:
  the groups' series are no partition of the total, which counts a shared block once).
- ``llmkit:prefix_cache_queries_total`` / ``llmkit:prefix_cache_hits_total`` (counters): tokens
  looked up in the prefix cache / tokens served from it (hit rate = hits / queries).
- ``llmkit:num_preemptions_total`` (counter): preemptions since start-up.
- ``llmkit:slo_rejected_requests_total`` / ``llmkit:slo_deferred_requests_total`` (counters):
  requests that ``scheduler=slo`` with ``scheduler.slo_admission=reject`` ended unserved
  (answered 429), and with ``defer`` moved behind the requests that can still meet their SLO
  (each request counted once), because the cost model predicted they would miss ``slo.*``;
  0 under other schedulers.
- ``llmkit:encoder_cache_queries_total`` / ``llmkit:encoder_cache_hits_total`` (counters):
  images looked up in the encoder cache / found there (not encoded again);
  ``llmkit:encoder_runs_total`` (counter): images encoded; ``llmkit:encoder_cache_tokens``
  (gauge): image tokens whose encoder outputs are cached (of ``scheduler.encoder_cache_size``).
- ``llmkit:engine_up`` (gauge): 1 while the engine core process is alive (with data
  parallel: while every engine core is).
- Data parallel (``parallel.data_parallel_size`` > 1): the series above are sums over the
  engine cores (``kv_cache_usage_perc``: of all their blocks); each core's own are
  ``llmkit:engine_core_up``, ``llmkit:engine_core_num_requests_running``,
  ``llmkit:engine_core_num_requests_waiting`` and ``llmkit:engine_core_kv_cache_usage_perc``
  (gauges) with the label ``engine`` (its index, 0-based).
- With LoRA (``lora.enabled``): ``llmkit:lora_requests_info`` (gauge, vLLM's): labels
  ``max_lora`` (slots), ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated
  names of the adapters with requests running / waiting), value the time of the snapshot
  (Unix seconds); ``llmkit:lora_num_requests{lora_name, state}`` (gauge): requests per
  adapter, ``state`` ``running`` or ``waiting`` (base-model requests are not counted).

Speculative decoding (``speculative=...``; all 0 without it), counted when drafts are verified:

- ``llmkit:spec_decode_num_drafts_total`` (counter): verify steps of requests that had draft
  tokens (one per drafted request and step).
- ``llmkit:spec_decode_num_draft_tokens_total`` (counter): draft tokens proposed and verified.
- ``llmkit:spec_decode_num_accepted_tokens_total`` (counter): draft tokens accepted.
- ``llmkit:spec_decode_num_accepted_tokens_per_pos_total{position}`` (counter): drafts accepted
  at position ``position`` (0-based) of their run; acceptance rate = accepted / draft tokens,
  mean acceptance length = 1 + accepted / drafts.

And at the HTTP layer: ``llmkit:http_request_errors_total{status}``: requests answered with an
error (400, 401, 404, 503, 500 ...).
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmkit.scheduler.base import SchedulerStats

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# Each data-parallel engine core's gauges: (key, name, help).
_PER_ENGINE_GAUGES = (
    ("up", "llmkit:engine_core_up", "1 while this data-parallel engine core is alive."),
    ("running", "llmkit:engine_core_num_requests_running",
     "Requests in this engine core's running list."),
    ("waiting", "llmkit:engine_core_num_requests_waiting",
     "Requests in this engine core's waiting queue."),
    ("kv", "llmkit:engine_core_kv_cache_usage_perc",
     "Fraction (0..1) of this engine core's KV blocks in use."),
)


class _EngineStatsCollector:
    """Exports the latest engine stats snapshot at scrape time."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        s = m.last_stats
        labels = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("llmkit:num_requests_running", "Requests in the scheduler's running list.",
                    s.num_running if s else 0)
        yield gauge("llmkit:num_requests_waiting", "Requests in the scheduler's waiting queue.",
                    s.num_waiting if s else 0)
        yield gauge("llmkit:kv_cache_usage_perc",
                    "Fraction (0..1) of KV cache blocks held by requests or pinned.",
                    s.kv_usage if s else 0.0)
        by_group = GaugeMetricFamily("llmkit:kv_cache_group_usage_perc",
                                     "Fraction (0..1) of KV cache blocks held by requests, per "
                                     "KV-cache group.", labels=["model_name", "group"])
        for group, usage in sorted((s.kv_usage_by_group if s else {}).items()):
            by_group.add_metric([m.model_name, group], usage)
        yield by_group
        yield counter("llmkit:prefix_cache_queries",
                      "Tokens looked up in the prefix cache.", s.prefix_cache_queries if s else 0)
        yield counter("llmkit:prefix_cache_hits",
                      "Tokens served from the prefix cache.", s.prefix_cache_hits if s else 0)
        yield counter("llmkit:num_preemptions", "Preemptions since start-up.",
                      s.num_preemptions_total if s else 0)
        yield counter("llmkit:slo_rejected_requests",
                      "Requests the SLO scheduler refused (predicted to miss their SLO).",
                      s.slo_rejected_total if s else 0)
        yield counter("llmkit:slo_deferred_requests",
                      "Requests the SLO scheduler deferred (predicted to miss their SLO).",
                      s.slo_deferred_total if s else 0)
        enc = s.encoder_cache if s else None
        yield counter("llmkit:encoder_cache_queries", "Images looked up in the encoder cache.",
                      enc.queries if enc else 0)
        yield counter("llmkit:encoder_cache_hits",
                      "Images found in the encoder cache (not encoded again).",
                      enc.hits if enc else 0)
        yield counter("llmkit:encoder_runs", "Images encoded.", enc.num_encoder_runs if enc else 0)
        yield gauge("llmkit:encoder_cache_tokens",
                    "Image tokens whose encoder outputs are cached.",
                    enc.num_cached_tokens if enc else 0)
        yield gauge("llmkit:engine_up", "1 while the engine core process is alive.",
                    1.0 if m.engine_alive() else 0.0)
        spec = s.spec_decode if s else None
        yield counter("llmkit:spec_decode_num_drafts",
                      "Verify steps of requests with draft tokens.", spec.num_drafts if spec else 0)
        yield counter("llmkit:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      spec.num_draft_tokens if spec else 0)
        yield counter("llmkit:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec.num_accepted_tokens if spec else 0)
        per_pos = CounterMetricFamily("llmkit:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position of their run.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(spec.accepted_per_position if spec else ()):
            per_pos.add_metric([m.model_name, str(pos)], n)
        yield per_pos
        kc = s.kv_connector if s else None
        if kc is not None:  # only with kv_transfer / kv_offload (definitions in the README)
            yield counter("llmkit:kv_connector_loaded_blocks",
                          "KV blocks written into the pool from outside it.", kc.loaded_blocks)
            yield counter("llmkit:kv_connector_loaded_bytes",
                          "Bytes of those blocks.", kc.loaded_bytes)
            yield counter("llmkit:kv_connector_load_seconds",
                          "Worker time spent loading them.", kc.load_s)
            yield counter("llmkit:kv_connector_saved_blocks",
                          "KV blocks copied out of the pool (offloaded).", kc.saved_blocks)
            yield counter("llmkit:kv_connector_saved_bytes",
                          "Bytes of those blocks.", kc.saved_bytes)
            yield counter("llmkit:kv_connector_failed_loads",
                          "Requests whose KV load failed and that were recomputed.",
                          kc.failed_loads)
            hits = CounterMetricFamily("llmkit:kv_connector_hit_tokens",
                                       "Tokens loaded instead of computed, per tier "
                                       "(host, disk, remote).", labels=["model_name", "tier"])
            for tier, n in sorted(kc.hits_per_tier.items()):
                hits.add_metric([m.model_name, tier], n)
            yield hits
        if m.max_loras is not None:
            yield from self._lora(s)
        cores = m.engine_cores()
        if cores:
            yield from self._per_engine(cores)

    def _per_engine(self, cores):
        """Data parallel: each engine core's own gauges, labelled by its index (vLLM's
        ``engine`` label); the series above are the sums over the cores."""
        m = self.metrics
        families = {key: GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
                    for key, name, doc in _PER_ENGINE_GAUGES}
        for i, (alive, st) in enumerate(cores):
            labels = [m.model_name, str(i)]
            families["up"].add_metric(labels, 1.0 if alive else 0.0)
            families["running"].add_metric(labels, st.num_running if st else 0)
            families["waiting"].add_metric(labels, st.num_waiting if st else 0)
            families["kv"].add_metric(labels, st.kv_usage if st else 0.0)
        yield from families.values()

    def _lora(self, s: SchedulerStats | None):
        m = self.metrics
        running = s.running_lora_adapters if s else {}
        waiting = s.waiting_lora_adapters if s else {}
        info = GaugeMetricFamily("llmkit:lora_requests_info",
                                 "Running and waiting LoRA adapters (value: snapshot time).",
                                 labels=["model_name", "max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])
        info.add_metric([m.model_name, str(m.max_loras), ",".join(sorted(waiting)),
                         ",".join(sorted(running))], m.stats_time or time.time())
        yield info
        per = GaugeMetricFamily("llmkit:lora_num_requests", "Requests per LoRA adapter.",
                                labels=["model_name", "lora_name", "state"])
        for state, counts in (("running", running), ("waiting", waiting)):
            for name, n in sorted(counts.items()):
                per.add_metric([m.model_name, name, state], n)
        yield per


class ServerMetrics:
    """The server's metrics in their own registry (several servers or engines can live in one
    process); implements AsyncLLM's ``StatLogger`` hooks."""

    def __init__(self, model_name: str, *, registry: CollectorRegistry | None = None,
                 engine_alive: Callable[[], bool] = lambda: True,
                 max_loras: int | None = None,
                 engine_cores: Callable[[], list[tuple[bool, SchedulerStats | None]]]
                 = lambda: []) -> None:
        self.model_name = model_name
        # Data parallel: each engine core's (alive, latest stats); empty with one core.
        self.engine_cores = engine_cores
        self.max_loras = max_loras  # None: LoRA is off (no lora series)
        self.stats_time: float | None = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_alive = engine_alive
        self.last_stats: SchedulerStats | None = None
        r, ln = self.registry, ["model_name"]
        self.ttft = Histogram("llmkit:time_to_first_token_seconds",
                              "Time to first token: arrival in the API process to the first "
                              "generated token there.", ln, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmkit:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.", ln,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("llmkit:e2e_request_latency_seconds",
                             "Arrival in the API process to the final output.", ln,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("llmkit:request_queue_time_seconds",
                               "Arrival in the engine core to first scheduling.", ln,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmkit:prompt_tokens",
                                     "Prompt tokens of requests that produced a first token.",
                                     ln, registry=r)
        self.generation_tokens = Counter("llmkit:generation_tokens",
                                         "Generated tokens delivered.", ln, registry=r)
        self.finished = Counter("llmkit:request_success",
                                "Finished requests by finish reason (stop, length, abort, "
                                "error).", ln + ["finished_reason"], registry=r)
        self.http_errors = Counter("llmkit:http_request_errors",
                                   "Requests answered with an HTTP error, by status.",
                                   ln + ["status"], registry=r)
        self.registry.register(_EngineStatsCollector(self))
        name = model_name
        self._ttft, self._itl = self.ttft.labels(name), self.itl.labels(name)
        self._e2e, self._queue = self.e2e.labels(name), self.queue.labels(name)
        self._prompt = self.prompt_tokens.labels(name)
        self._gen = self.generation_tokens.labels(name)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(name, reason)

    # -- StatLogger ---------------------------------------------------------------------------
    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.last_stats = stats
        self.stats_time = time.time()

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt.inc(num_prompt_tokens)

    def on_new_tokens(self, num_tokens: int, inter_token_latency_s: float | None) -> None:
        self._gen.inc(num_tokens)
        if inter_token_latency_s is not None:
            per_token = inter_token_latency_s / max(num_tokens, 1)
            for _ in range(num_tokens):
                self._itl.observe(per_token)

    def on_finished(self, finish_reason: str, e2e_s: float, queue_time_s: float | None,
                    num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._e2e.observe(e2e_s)
        if queue_time_s is not None:
            self._queue.observe(queue_time_s)
        self.finished.labels(self.model_name, finish_reason).inc()

    # -- HTTP ---------------------------------------------------------------------------------
    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
