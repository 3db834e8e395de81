"""Where each data-parallel engine core runs, and the start-up checks of ``data_parallel_size``.

``parallel.data_parallel_size = N`` starts N engine cores, each its own process with its own
executor (which may itself run ``tensor_parallel_size * pipeline_parallel_size`` workers), KV
pool and scheduler. They must not fight over the machine:

- **CPU**: the usable cores (``os.sched_getaffinity``) are split into N contiguous slices, one
  per engine core; the core's process is bound to its slice before torch loads (its executor's
  workers inherit the binding and split the slice among their ranks) and runs as many torch
  threads as the slice has cores (or its share of ``platform.num_threads``). With fewer usable
  cores than engine cores nothing is bound and each gets ``max(1, cores // N)`` threads.
- **CUDA**: engine core ``i`` sees devices ``i*W .. (i+1)*W - 1`` (``W`` = its ranks) through
  ``CUDA_VISIBLE_DEVICES``, set in its process before torch loads.

Combinations the engine cores cannot share are refused with a ``ConfigError`` naming the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from llmkit.config.errors import ConfigError
from llmkit.config.openmp_env import likely_cuda
from llmkit.config.schema import EngineConfig

__all__ = ["CorePlacement", "check_data_parallel_config", "core_config", "plan_placements"]


@dataclass(frozen=True, slots=True)
class CorePlacement:
    """One engine core's share of the machine."""

    index: int
    # CPUs the core's process (and its workers) is bound to; None = unbound.
    cpus: tuple[int, ...] | None = None
    # torch threads of the core (split further among its ranks by the executor); 0 = default.
    num_threads: int = 0
    # CUDA devices the core sees (CUDA_VISIBLE_DEVICES); None = unchanged.
    cuda_visible_devices: str | None = None

    def describe(self) -> str:
        if self.cuda_visible_devices is not None:
            return f"CUDA devices {self.cuda_visible_devices}"
        where = f"CPUs {','.join(map(str, self.cpus))}" if self.cpus else "unbound"
        return f"{self.num_threads} threads, {where}"


def check_data_parallel_config(config: EngineConfig) -> None:
    """Refuse what several engine cores behind one front end cannot do (one-line errors)."""
    dp = config.parallel.data_parallel_size
    if dp == 1:
        return
    why = "with parallel.data_parallel_size > 1"
    if config.kv_transfer.name != "none":
        raise ConfigError("kv_transfer.name", config.kv_transfer.name, f"none {why} (the "
                          "engine cores would expose their KV under one engine id)")
    if config.kv_offload.disk_path is not None:
        raise ConfigError("kv_offload.disk_path", config.kv_offload.disk_path, f"null {why} "
                          "(the engine cores would write the same files; host_gib works)")
    if config.executor.name == "ray":
        raise ConfigError("executor.name", "ray", f"auto, uniproc or multiproc {why}")


def plan_placements(config: EngineConfig) -> list[CorePlacement]:
    """One placement per engine core; ``ConfigError`` if the sizes do not fit the machine."""
    par = config.parallel
    dp, world = par.data_parallel_size, par.world_size
    if likely_cuda(config.platform.name):
        return _cuda_placements(dp, world)
    from llmkit.config.cpu_dispatch import resolve_dispatch
    from llmkit.config.cpu_isa import resolve_tier

    # the CPU platform's table (platform.dispatch.ranks_per_core), resolved from the config:
    # no platform exists yet when the engine cores are placed
    per_core = resolve_dispatch(resolve_tier(config.platform.isa),
                                config.platform.dispatch).ranks_per_core
    cpus = sorted(os.sched_getaffinity(0))
    limit = per_core * len(cpus)
    if dp * world > limit:
        raise ConfigError("parallel.data_parallel_size", dp,
                          f"at most {max(1, limit // world)} on this machine: "
                          f"{per_core} ranks per usable CPU core ({len(cpus)}), "
                          f"{world} rank(s) per engine core "
                          "(tensor_parallel_size * pipeline_parallel_size)")
    threads_total = config.platform.num_threads or len(cpus)
    if len(cpus) < dp:
        share = max(1, threads_total // dp)
        return [CorePlacement(i, None, share) for i in range(dp)]
    slices = _split(cpus, dp)
    return [CorePlacement(i, tuple(s), max(1, min(len(s), threads_total // dp)))
            for i, s in enumerate(slices)]


def _split(items: list[int], n: int) -> list[list[int]]:
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(items[start:start + size])
        start += size
    return out


def _cuda_placements(dp: int, world: int) -> list[CorePlacement]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = ([d.strip() for d in visible.split(",") if d.strip()] if visible is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    if dp * world > len(devices):
        raise ConfigError("parallel.data_parallel_size", dp,
                          f"at most {max(1, len(devices) // world)} on this machine: "
                          f"{len(devices)} CUDA device(s), {world} per engine core")
    return [CorePlacement(i, cuda_visible_devices=",".join(devices[i * world:(i + 1) * world]))
            for i in range(dp)]


def core_config(config: EngineConfig, placement: CorePlacement) -> EngineConfig:
    """The config engine core ``placement.index`` runs: one data-parallel rank, its thread
    share, and its own trace file (``name.engineN.json``)."""
    par = config.parallel.model_copy(update={"data_parallel_size": 1})
    update: dict = {"parallel": par}
    if placement.num_threads:
        update["platform"] = config.platform.model_copy(
            update={"num_threads": placement.num_threads})
    trace = config.observability.trace_file
    if trace:
        p = Path(trace)
        update["observability"] = config.observability.model_copy(
            update={"trace_file": str(p.with_name(f"{p.stem}.engine{placement.index}{p.suffix}"))})
    return config.model_copy(update=update)
