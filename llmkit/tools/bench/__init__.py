"""Measuring llmkit: serving metrics (``metrics``), workloads (``datasets``, ``arrivals``), the
streaming load generator (``client``), result files and figures (``results``, ``plot``), and the
offline benchmarks (``throughput``, ``latency``, ``hf_baseline``).

The command line is ``llmkit bench serve|throughput|latency|plot`` (``llmkit.tools.bench.cli``).
Workload generation and metric math are pure, so the simulator replays the same workloads and
writes the same result files.
"""
from llmkit.tools.bench.arrivals import arrival_times
from llmkit.tools.bench.datasets import WorkloadRequest, build_workload
from llmkit.tools.bench.metrics import RequestRecord, Slo, meets_slo, request_record, summarize
from llmkit.tools.bench.results import make_result, write_result

__all__ = ["RequestRecord", "Slo", "WorkloadRequest", "arrival_times", "build_workload",
           "make_result", "meets_slo", "request_record", "summarize", "write_result"]
