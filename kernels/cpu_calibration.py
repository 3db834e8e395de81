"""The CPU dispatch table's calibration: the speed-only fields timed on the real kernels.

``llmkit.config.cpu_dispatch.CALIBRATED`` names the fields whose every value computes the same
bits (the C++ linears' prefetch distance and least weight bytes per thread,
``kernels/cpu/tuning.h``). The platform times each field's ``CANDIDATES`` at first start on a
decode-shaped workload -- one row through a small model's worth of Q4_1 and bf16 weights,
tens of MB, so that the weights stream from memory as a decode step's do -- in alternated
rounds (the candidates' order reversed every other round, so a drift in the machine's load
weighs on all alike), and keeps the fastest median; the tier's default stays unless another
is faster by ``MARGIN``, so that noise does not flip the table from start to start. The whole
takes a few seconds (fewer rounds where the machine is so loaded that the warm-up says the
rounds would take more than ``BUDGET_S`` per field); the result is cached next to the kernel build
(``<llmkit cache>/cpu_kernels/<build key>/``), in a file keyed by the CPU's model name and
flags, the tier, the torch thread count and the candidates, which later starts read -- unless
the machine was busy while it timed (``MachineLoad``: its load average before, or the CPU the
other processes took during the timing, above ``BUSY_LOAD`` per core): then the values serve
that start only, and the next one times again. Both are needed: the load average lags by a
minute, so a job that starts with the timing is seen only in the CPU it takes meanwhile, and
one timing under such a burst chose one thread per weight for every weight (2 threads ran
2x slower while another process held a core) and was cached for every later start.
``platform.calibrate`` (auto, force, off) decides; fields given in ``platform.dispatch`` are
never timed. Ranks of one engine that start together on a cold cache each time (with their own
thread counts, so under their own keys) and write whole files.

The timer, the kernels and the cache folder are parameters, so that tests time on a fake clock
(deterministic) and no test depends on a real timing.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmkit.config import cpu_isa
from llmkit.config.cpu_dispatch import CALIBRATED, CpuDispatch, dispatch_sources
from llmkit.config.errors import ConfigError
from llmkit.startup import startup_step

logger = logging.getLogger(__name__)

__all__ = ["BUDGET_S", "BUSY_DURING", "BUSY_LOAD", "CANDIDATES", "MARGIN", "ROUNDS",
           "MachineLoad", "apply_tuning", "calibrate", "calibration_key", "cached_calibration",
           "cached_fields", "calibration_file", "calibrated_fields", "load_per_core", "pick",
           "time_candidates"]

#: The values timed per field. ``linear_thread_min_bytes``' largest keeps every weight on one
#: thread.
CANDIDATES: dict[str, tuple[int, ...]] = {
    "linear_prefetch_bytes": (0, 512, 1024, 2048, 4096, 8192),
    # 4 MiB: a decode step's layers on one thread, an LM head (30-60 MB) split, where waking
    # a sleeping thread for each small weight costs more than it saves
    "linear_thread_min_bytes": (0, 8192, 32768, 131072, 524288, 1 << 22, 1 << 30),
}
#: A candidate replaces the tier's default only when its median is this much faster.
MARGIN = 0.03
#: Timed rounds per field (each times every candidate once), and the seconds they may take.
ROUNDS = 7
BUDGET_S = 2.0
#: Bumped when the workload changes, which invalidates every cached calibration.
WORKLOAD_VERSION = 2

Timer = Callable[[], float]

#: Runnable processes per usable core (the 1-minute load average), or cores' worth of CPU the
#: other processes took while the calibration timed, per usable core, above which an ``auto``
#: calibration is not cached: with the cores shared, one thread per weight wins, which an
#: idle machine would not choose.
BUSY_LOAD = 0.75
#: The same bound for the CPU other processes took during the timing (a tighter one: that is
#: measured over the timing itself, not averaged over the minute before).
BUSY_DURING = 0.2


def load_per_core() -> float:
    """The 1-minute load average per core this process may use (0 where unknown)."""
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):  # not Linux / no load average
        return 0.0


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every CPU since boot (/proc/stat), steal counted as busy
    (the host ran something else); None where unknown."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class MachineLoad:
    """How busy the machine is, per usable core, called before and after the timing: first the
    1-minute load average; then the larger of that and the CPU the other processes took since
    the first call (the machine's busy ticks less this process's own), scaled so that
    ``BUSY_DURING`` of it weighs as ``BUSY_LOAD`` of the load average."""

    def __init__(self) -> None:
        self._start: tuple[tuple[int, int], float] | None = None

    def __call__(self) -> float:
        before = load_per_core()
        ticks, own = _cpu_ticks(), _own_cpu_seconds()
        if self._start is None or ticks is None or self._start[0] is None:
            self._start = (ticks, own)
            return before
        (busy0, total0), own0 = self._start
        busy, total = ticks[0] - busy0, ticks[1] - total0
        hz = os.sysconf("SC_CLK_TCK")
        others = max(0.0, busy - (own - own0) * hz) / max(1, total)  # share of all CPUs
        per_core = others * (os.cpu_count() or 1) / max(1, len(os.sched_getaffinity(0)))
        return max(before, per_core * BUSY_LOAD / BUSY_DURING)


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def calibration_key(tier: str | None, kernels_key: str, threads: int) -> dict[str, Any]:
    """What a calibration's result depends on besides the kernels' build (whose folder holds
    it): the CPU, the tier, the threads, the candidates and the workload."""
    return {"cpu_model": cpu_isa.cpu_model(), "cpu_flags": sorted(cpu_isa.cpu_flags()),
            "tier": tier, "kernels": kernels_key, "threads": threads,
            "candidates": {name: list(values) for name, values in CANDIDATES.items()},
            "workload": WORKLOAD_VERSION}


def calibration_file(folder: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"dispatch_calibration-{digest}.json"


def cached_calibration(path: Path, key: dict[str, Any]) -> dict[str, int] | None:
    """The fields cached at ``path`` for ``key``; None when absent, unreadable, of another key
    or holding a value that is not a candidate."""
    with contextlib.suppress(OSError, ValueError):  # absent or torn: time again
        data = json.loads(path.read_text())
        choice = data.get("choice") if data.get("key") == key else None
        if isinstance(choice, dict) and set(choice) == set(CALIBRATED) and all(
                choice[name] in CANDIDATES[name] for name in CALIBRATED):
            return {name: int(choice[name]) for name in CALIBRATED}
    return None


def _write_cache(path: Path, key: dict[str, Any], choice: dict[str, int],
                 medians: dict[str, dict[int, float]]) -> None:
    # whole or not at all: another process may be reading it
    data = {"key": key, "choice": choice,
            "median_seconds": {n: {str(v): t for v, t in m.items()} for n, m in medians.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o644)  # like the build beside it (mkstemp makes it private)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: the next start times again
        logger.warning("could not cache the CPU dispatch calibration in %s: %s", path, exc)


def apply_tuning(kernels, table: CpuDispatch) -> None:
    """Hand the table's speed-only fields to the loaded kernels."""
    kernels.set_linear_tuning(table.linear_prefetch_bytes, table.linear_thread_min_bytes)
    kernels.set_thread_pool_spin_us(table.thread_pool_spin_us)


def time_candidates(candidates: tuple[int, ...], run: Callable[[int], None], timer: Timer,
                    rounds: int = ROUNDS, budget_s: float = BUDGET_S) -> dict[int, float]:
    """Median seconds of ``run(value)`` per candidate over alternated rounds (each candidate
    warmed once first): ``rounds``, fewer (2 at least) where the warm-up says they would take
    more than ``budget_s`` (a loaded machine)."""
    start = timer()
    for value in candidates:
        run(value)
    per_round = max(timer() - start, 1e-9)
    rounds = max(2, min(rounds, int(budget_s / per_round)))
    times: dict[int, list[float]] = {value: [] for value in candidates}
    for r in range(rounds):
        for value in candidates if r % 2 == 0 else reversed(candidates):
            start = timer()
            run(value)
            times[value].append(timer() - start)
    return {value: statistics.median(t) for value, t in times.items()}


def pick(medians: dict[int, float], default: int) -> int:
    """The fastest candidate, if faster than ``default`` by ``MARGIN``; else ``default``.
    Ties go to the first candidate."""
    best = min(medians, key=lambda v: (medians[v], list(medians).index(v)))
    if default in medians and medians[best] > medians[default] * (1 - MARGIN):
        return default
    return best


class _Workload:
    """One decode row through a small Llama's worth of weights (tens of MB: more than the
    caches of most CPUs, so the weights stream from memory): Q4_1 (the default model's
    format) merged q|k|v, o, gate|up and down projections of a 576-wide model, and a few bf16
    weights for the bf16 linear's prefetch."""

    Q4_1_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
    LAYERS = 16
    BF16_SHAPES = ((1536, 576), (576, 1536)) * 2

    #: The default model's LM head (Q8_0): the one weight of a step large enough that splitting
    #: it over the threads pays on any machine, so that the choice weighs large weights too.
    HEAD = (49152, 576)

    def __init__(self, kernels, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.kernels = kernels
        self.q4 = [(self._q4_1(rng, out, k), out, k)
                   for _ in range(self.LAYERS) for out, k in self.Q4_1_SHAPES]
        self.head = (self._q8_0(rng, *self.HEAD), *self.HEAD)
        gen = torch.Generator().manual_seed(seed)
        self.bf16 = [torch.randn(out, k, generator=gen).mul_(0.05).to(torch.bfloat16)
                     for out, k in self.BF16_SHAPES]
        self.x = {k: torch.randn(1, k, generator=gen) for k in (576, 1536)}
        self.xb = {k: v.to(torch.bfloat16) for k, v in self.x.items()}

    def _q4_1(self, rng: np.random.Generator, out: int, k: int) -> torch.Tensor:
        blocks = rng.integers(0, 256, size=(out * k // 32, 20), dtype=np.uint8)
        for at, scale in ((0, 0.002), (2, -0.01)):  # valid fp16 d and m
            value = (rng.uniform(0.5, 1.5, len(blocks)) * scale).astype(np.float16)
            blocks[:, at:at + 2] = value.view(np.uint8).reshape(-1, 2)
        raw = torch.from_numpy(blocks.reshape(out, -1))
        return self.kernels.quant_repack(raw, "q4_1", k)

    def _q8_0(self, rng: np.random.Generator, out: int, k: int) -> torch.Tensor:
        blocks = rng.integers(-64, 64, size=(out * k // 32, 34), dtype=np.int8).view(np.uint8)
        scale = (rng.uniform(0.5, 1.5, len(blocks)) * 0.002).astype(np.float16)
        blocks[:, 0:2] = scale.view(np.uint8).reshape(-1, 2)  # a valid fp16 d
        return self.kernels.quant_repack(torch.from_numpy(blocks.reshape(out, -1)), "q8_0", k)

    def step(self) -> None:
        for packed, out, k in self.q4:
            self.kernels.quant_linear(self.x[k], packed, "q4_1", out, None, None, False, False)
        for w in self.bf16:
            self.kernels.linear(self.xb[w.shape[1]], w, None)
        packed, out, k = self.head
        self.kernels.quant_linear(self.x[k], packed, "q8_0", out, None, None, False, False)


def calibrate(kernels, defaults: CpuDispatch, fields: tuple[str, ...] = CALIBRATED, *,
              timer: Timer = time.perf_counter, rounds: int = ROUNDS,
              budget_s: float = BUDGET_S) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
    """Time ``fields``' candidates one field after the other (the others at their value so
    far: the defaults, then the fields chosen), leaving the kernels tuned to the choice.
    Returns the choice and each field's medians."""
    work = _Workload(kernels)
    chosen = {name: getattr(defaults, name) for name in CALIBRATED}
    medians: dict[str, dict[int, float]] = {}

    def run(name: str, value: int) -> None:
        tuning = {**chosen, name: value}
        kernels.set_linear_tuning(tuning["linear_prefetch_bytes"],
                                  tuning["linear_thread_min_bytes"])
        work.step()

    for name in fields:
        medians[name] = time_candidates(CANDIDATES[name], lambda v, n=name: run(n, v), timer,
                                        rounds, budget_s)
        chosen[name] = pick(medians[name], getattr(defaults, name))
    kernels.set_linear_tuning(chosen["linear_prefetch_bytes"], chosen["linear_thread_min_bytes"])
    return {name: chosen[name] for name in fields}, medians


def calibrated_fields(kernels, tier: str | None, defaults: CpuDispatch, mode: str,
                      given: set[str], folder: Path, kernels_key: str, *,
                      timer: Timer = time.perf_counter,
                      load: Callable[[], float] | None = None) -> dict[str, int]:
    """The calibrated values of the fields not in ``given`` (``platform.calibrate`` =
    ``mode``): read from the cache in ``folder`` (auto), timed now and cached (auto on a miss,
    force), or none (off). With ``auto`` on a busy machine (``load()``, default
    ``MachineLoad``, called before and after the timing, above ``BUSY_LOAD`` either time) the
    values timed are used but not cached: they reflect the other processes, and the next start
    times again."""
    if mode not in ("auto", "off", "force"):
        raise ConfigError("platform.calibrate", mode, "auto, off or force")
    fields = tuple(name for name in CALIBRATED if name not in given)
    if mode == "off" or not fields:
        return {}
    key = calibration_key(tier, kernels_key, torch.get_num_threads())
    path = calibration_file(folder, key)
    cached = cached_calibration(path, key) if mode == "auto" else None
    if cached is not None:
        return {name: cached[name] for name in fields}
    load = load or MachineLoad()
    busy = load()
    start = time.perf_counter()
    with startup_step("timing the CPU kernels' prefetch distance and thread split (once per "
                      "machine and build, a few seconds; platform.calibrate=off skips it)"):
        choice, medians = calibrate(kernels, defaults, CALIBRATED, timer=timer)
    busy = max(busy, load())
    took, summary = time.perf_counter() - start, " ".join(f"{n}={v}" for n, v in choice.items())
    if mode == "auto" and busy > BUSY_LOAD:
        logger.info("CPU dispatch calibrated in %.1f s: %s, for this start only: the machine is "
                    "busy (load %.1f per core), so the next start times again "
                    "(platform.calibrate=force caches it anyway)", took, summary, busy)
    else:
        _write_cache(path, key, choice, medians)
        logger.info("CPU dispatch calibrated in %.1f s: %s (cached in %s)", took, summary, path)
    return {name: choice[name] for name in fields}


def cached_fields(tier: str | None, config) -> tuple[dict[str, int], str]:
    """For ``llmkit config``: the calibrated fields that a start with the platform group
    ``config`` would read from the cache now (nothing is timed), and a note saying where they
    stand."""
    if config.native_kernels == "off":
        return {}, "platform.native_kernels=off: no C++ kernels to tune"
    if config.calibrate == "off":
        return {}, "platform.calibrate=off: the tier's speed-only fields"
    given = {name for name, source in dispatch_sources(config.dispatch).items()
             if source == "given"}
    fields = [name for name in CALIBRATED if name not in given]
    if not fields:
        return {}, "every speed-only field given"
    from llmkit.kernels.cpu_native import build_directory, kernels_build_key

    kernels_key = kernels_build_key(tier)
    key = calibration_key(tier, kernels_key,
                          config.num_threads or len(os.sched_getaffinity(0)))
    path = calibration_file(build_directory(kernels_key), key)
    cached = cached_calibration(path, key) if config.calibrate == "auto" else None
    if cached is None:
        return {}, (f"platform.calibrate={config.calibrate}: the next start times the "
                    "speed-only fields")
    return {name: cached[name] for name in fields}, f"calibration {path}"
