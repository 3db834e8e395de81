"""The search space of ``llmkit plan``: every combination of the ``plan.*`` lists that the
engine can run and the cores allow.

A combination is left out (and counted, by reason) when TP x PP x DP exceeds ``plan.cores``,
when it drafts under pipeline parallelism (the engine does not), and speculation off takes one
K (0) rather than one per ``plan.num_speculative_tokens``, as the token-budget scheduler takes
one ``slo_admission`` / ``slo_tpot`` (their defaults) rather than one per value.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass
from typing import Any

from llmkit.config.compose import group_options
from llmkit.config.errors import ConfigError

__all__ = ["Candidate", "SearchSpace", "build_space", "usable_cores"]


@dataclass(frozen=True)
class Candidate:
    """One engine configuration the plan simulates (the values of the searched keys)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    scheduler: str = "token_budget"
    policy: str = "fcfs"
    speculative: str = "none"
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # scheduler=slo only (the token-budget scheduler's are these defaults)
    slo_admission: str = "off"
    slo_tpot: str = "step"

    @property
    def devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * \
            self.data_parallel_size

    def overrides(self) -> list[str]:
        """The Hydra overrides that give an engine this configuration."""
        out = [f"scheduler={self.scheduler}",
               f"scheduler.max_num_seqs={self.max_num_seqs}",
               f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}",
               f"scheduler.policy={self.policy}",
               f"speculative={self.speculative}",
               f"kv_cache.cache_dtype={self.kv_cache_dtype}",
               f"model.quantization={self.quantization}",
               f"parallel.tensor_parallel_size={self.tensor_parallel_size}",
               f"parallel.pipeline_parallel_size={self.pipeline_parallel_size}",
               f"parallel.data_parallel_size={self.data_parallel_size}"]
        if self.speculative != "none":
            out.append(f"speculative.num_speculative_tokens={self.num_speculative_tokens}")
        if self.scheduler == "slo":
            out += [f"scheduler.slo_admission={self.slo_admission}",
                    f"scheduler.slo_tpot={self.slo_tpot}"]
        return out

    def values(self) -> dict[str, Any]:
        return asdict(self)

    def label(self, keys: list[str] | None = None) -> str:
        """``key=value`` for ``keys`` (default: all), short names."""
        vals = self.values()
        return " ".join(f"{SHORT.get(k, k)}={vals[k]}" for k in (keys or list(vals)))


# column names in the table and the progress lines
SHORT = {"max_num_seqs": "seqs", "max_num_batched_tokens": "tokens", "scheduler": "sched",
         "policy": "policy", "speculative": "spec", "num_speculative_tokens": "K",
         "kv_cache_dtype": "kv", "quantization": "quant", "tensor_parallel_size": "TP",
         "pipeline_parallel_size": "PP", "data_parallel_size": "DP",
         "slo_admission": "admit", "slo_tpot": "tpot"}


@dataclass
class SearchSpace:
    candidates: list[Candidate]
    # knobs with more than one value (the table's and the plot's columns)
    varied: list[str]
    # reason -> how many combinations it left out
    skipped: dict[str, int]


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_group(key: str, values: list[str], group: str) -> None:
    from llmkit.tools.compose import TOOLS_ROOT

    options = group_options(group, TOOLS_ROOT)
    for v in values:
        if v not in options:
            raise ConfigError(f"plan.{key}", v, ", ".join(options))


def build_space(plan: Any, cores: int | None = None) -> SearchSpace:
    """The candidates of ``plan`` (a ``PlanConfig``), in a fixed order (the lists' orders), with
    ``cores`` (default ``plan.cores``, else ``usable_cores()``) bounding TP x PP x DP."""
    _check_group("scheduler", plan.scheduler, "scheduler")
    _check_group("speculative", plan.speculative, "speculative")
    cores = cores or plan.cores or usable_cores()
    skipped: dict[str, int] = {}
    out: list[Candidate] = []
    seen: set[Candidate] = set()
    for (seqs, tokens, sched, policy, admit, tpot, spec, k, kv, quant, tp, pp, dp) in \
            itertools.product(
                plan.max_num_seqs, plan.max_num_batched_tokens, plan.scheduler, plan.policy,
                plan.slo_admission, plan.slo_tpot, plan.speculative,
                plan.num_speculative_tokens, plan.kv_cache_dtype, plan.quantization,
                plan.tensor_parallel_size, plan.pipeline_parallel_size,
                plan.data_parallel_size):
        if spec == "none":
            k = 0
        if sched != "slo":  # one candidate for the SLO scheduler's keys at their defaults
            admit, tpot = "off", "step"
        cand = Candidate(seqs, tokens, sched, policy, spec, k, kv, quant, tp, pp, dp,
                         slo_admission=admit, slo_tpot=tpot)
        if cand in seen:
            continue
        seen.add(cand)
        if cand.devices > cores:
            why = f"TP x PP x DP > {cores} cores"
        elif pp > 1 and spec != "none":
            why = "speculation under pipeline parallelism"
        else:
            out.append(cand)
            continue
        skipped[why] = skipped.get(why, 0) + 1
    if not out:
        raise ConfigError("plan.tensor_parallel_size", list(plan.tensor_parallel_size), "",
                          message=(f"no combination of plan.* runs here ({', '.join(skipped)});"
                                   f" with {cores} cores, TP x PP x DP must be at most {cores} "
                                   "(plan.cores sets the count)"))
    varied = [k for k in Candidate.__dataclass_fields__
              if len({getattr(c, k) for c in out}) > 1]
    return SearchSpace(out, varied, skipped)
