"""The CPU dispatch table's calibration (``llmkit.kernels.cpu_calibration``): the fields it
times change speed only (every candidate computes the same bits on the real kernels, every
tier), the choice on a fake clock is deterministic, the cache is written, read and keyed,
``platform.dispatch`` wins, and bad values are config errors naming the key. No test here
depends on a real timing."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from llmkit.config.cpu_dispatch import CALIBRATED, CpuDispatch, resolve_dispatch
from llmkit.config.cpu_isa import resolve_tier, supported_tiers
from llmkit.config.errors import ConfigError
from llmkit.config.schema import PlatformConfig
from llmkit.entrypoints.cli import main
from llmkit.kernels.cpu_native import build_directory, kernels_build_key, load_cpu_kernels
from llmkit.platforms import CpuPlatform
from llmkit.kernels import cpu_calibration as calibration
from llmkit.kernels.cpu_calibration import (CANDIDATES, calibrate, calibrated_fields,
                                              calibration_file, calibration_key, pick,
                                              time_candidates)

from helpers.gguf_rows import random_gguf_rows

DEFAULTS = CpuDispatch()


# -- the rule: every candidate computes the same bits ------------------------------------------

def _weights(ops):
    """A weight of every linear the tuning reaches, with more output groups than threads and a
    tail group: (name, run(x) -> y) pairs."""
    gen = torch.Generator().manual_seed(0)
    out, k = 203, 512
    runs = []
    for fmt in ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k"):
        packed = ops.quant_repack(random_gguf_rows(fmt, out, k, seed=1), fmt, k)
        runs.append((fmt, lambda x, p=packed, f=fmt: ops.quant_linear(
            x, p, f, out, None, None, False, False)))
    packed_f = ops.quant_repack(random_gguf_rows("q4_1", out, k, seed=2), "q4_1", k)
    runs.append(("q4_1 float activations", lambda x: ops.quant_linear(
        x, packed_f, "q4_1", out, None, None, True, False)))
    for fmt, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        codes = (torch.randn(out, k, generator=gen) * 20).clamp(-100, 100).to(dtype)
        raw = codes.view(torch.uint8).contiguous()
        packed_c = ops.quant_repack(raw, fmt, k)
        scales = torch.rand(out, generator=gen) + 0.5
        runs.append((fmt, lambda x, p=packed_c, f=fmt, s=scales: ops.quant_linear(
            x, p, f, out, s, None, False, False)))
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(out, k, generator=gen).to(dtype)
        runs.append((f"linear {dtype}", lambda x, w=w: ops.linear(x.to(w.dtype), w, None)))
    return runs


@pytest.mark.parametrize("tier", supported_tiers())
def test_every_candidate_computes_the_same_bits(tier):
    """The rule: a timed field never changes outputs. Every candidate of each calibrated field
    (the others at their defaults), on every linear it reaches, at decode and prefill row
    counts (1-3 rows; 17: the fp8 float tile), gives the default table's bits on every tier;
    and the candidates do reach the kernels (read back)."""
    ops = load_cpu_kernels(tier)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows, 512, generator=gen) for rows in (1, 2, 3, 17)]
    runs = _weights(ops)
    try:
        ops.set_linear_tuning(DEFAULTS.linear_prefetch_bytes, DEFAULTS.linear_thread_min_bytes)
        expected = [[run(x) for x in xs] for _, run in runs]
        for name in CALIBRATED:
            for value in CANDIDATES[name]:
                tuning = {**{n: getattr(DEFAULTS, n) for n in CALIBRATED}, name: value}
                ops.set_linear_tuning(tuning["linear_prefetch_bytes"],
                                      tuning["linear_thread_min_bytes"])
                assert list(ops.linear_tuning()) == [tuning["linear_prefetch_bytes"],
                                                     tuning["linear_thread_min_bytes"]]
                for (what, run), want in zip(runs, expected):
                    for x, y in zip(xs, want):
                        assert torch.equal(run(x), y), (tier, name, value, what, x.shape[0])
    finally:
        ops.set_linear_tuning(DEFAULTS.linear_prefetch_bytes, DEFAULTS.linear_thread_min_bytes)


def test_the_thread_split_is_exercised():
    """The candidates span one thread per weight to every thread (so the test above compares
    split against unsplit weights where the machine has two threads or more)."""
    assert min(CANDIDATES["linear_thread_min_bytes"]) == 0
    assert max(CANDIDATES["linear_thread_min_bytes"]) >= 1 << 30
    assert 0 in CANDIDATES["linear_prefetch_bytes"]
    for name in CALIBRATED:
        assert getattr(DEFAULTS, name) in CANDIDATES[name]


# -- the choice, on a fake clock ---------------------------------------------------------------

class FakeKernels:
    """Stands in for the kernels: records the tuning and advances a fake clock by what each
    (prefetch, thread bytes) pair "costs" per linear call."""

    def __init__(self, cost):
        self.cost, self.now, self.tuning, self.calls = cost, 0.0, None, 0

    def clock(self) -> float:
        return self.now

    def set_linear_tuning(self, prefetch, thread_min_bytes):
        self.tuning = (prefetch, thread_min_bytes)

    def set_thread_pool_spin_us(self, spin_us):
        self.spin_us = spin_us

    def quant_repack(self, raw, fmt, k):
        return raw

    def quant_linear(self, x, packed, fmt, out, *args):
        self._tick()

    def linear(self, x, w, bias):
        self._tick()

    def _tick(self):
        self.calls += 1
        self.now += self.cost(*self.tuning)


def _cost(prefetch, thread_bytes):
    # fastest at 4096 bytes ahead and 32 KiB per thread; prefetch weighs more
    return 1.0 + abs(prefetch - 4096) / 1e4 + abs(thread_bytes - 32768) / 1e5


def test_the_calibration_on_a_fake_clock_is_deterministic():
    fake = FakeKernels(_cost)
    choice, medians = calibrate(fake, DEFAULTS, timer=fake.clock, rounds=3, budget_s=1e9)
    assert choice == {"linear_prefetch_bytes": 4096, "linear_thread_min_bytes": 32768}
    assert fake.tuning == (4096, 32768)  # left tuned to the choice
    again = FakeKernels(_cost)
    assert calibrate(again, DEFAULTS, timer=again.clock, rounds=3, budget_s=1e9) == (
        choice, medians)
    # the second field was timed with the first one chosen
    per_step = fake.calls / (sum(len(CANDIDATES[n]) for n in CALIBRATED) * 4)
    assert medians["linear_thread_min_bytes"][32768] == pytest.approx(per_step * 1.0)


def test_the_default_stays_unless_clearly_faster():
    assert pick({0: 1.0, 2048: 1.02, 4096: 1.5}, default=2048) == 2048  # within the margin
    assert pick({0: 0.9, 2048: 1.0}, default=2048) == 0
    assert pick({0: 1.0, 512: 1.0, 2048: 2.0}, default=2048) == 0  # a tie: the first


def test_rounds_alternate_the_candidates_order_within_the_budget():
    seen = []
    time_candidates((1, 2, 3), seen.append, timer=lambda: 0.0, rounds=2)
    assert seen == [1, 2, 3, 1, 2, 3, 3, 2, 1]  # warm-up, then forward and reversed
    clock = iter(range(1000))
    seen.clear()  # a warm-up of 1 "s" (two clock reads) with 3.5 s left: 3 rounds of 7
    time_candidates((1, 2, 3), seen.append, timer=lambda: next(clock), rounds=7, budget_s=3.5)
    assert len(seen) == 3 + 3 * 3


# -- the cache ---------------------------------------------------------------------------------

def _fields(fake, tmp_path, mode="auto", given=(), kernels_key="k1", tier="avx2", load=0.1):
    return calibrated_fields(fake, tier, DEFAULTS, mode, set(given), tmp_path, kernels_key,
                             timer=fake.clock, load=lambda: load)


def test_the_cache_is_written_read_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    fake = FakeKernels(_cost)
    first = _fields(fake, tmp_path)
    assert first == {"linear_prefetch_bytes": 4096, "linear_thread_min_bytes": 32768}
    [path] = tmp_path.glob("dispatch_calibration-*.json")
    data = json.loads(path.read_text())
    assert data["choice"] == first and data["key"]["kernels"] == "k1"
    assert data["key"]["cpu_flags"] and data["key"]["threads"] == torch.get_num_threads()

    # a later start reads it: nothing timed, even if the machine now "prefers" another value
    later = FakeKernels(lambda p, t: 1.0 + abs(p - 512) / 1e4)
    assert _fields(later, tmp_path) == first and later.calls == 0
    # force times again and rewrites it
    assert _fields(later, tmp_path, mode="force")["linear_prefetch_bytes"] == 512
    assert json.loads(path.read_text())["choice"]["linear_prefetch_bytes"] == 512

    # another build, tier or CPU is another key: timed again, in a file of its own
    other = FakeKernels(_cost)
    assert _fields(other, tmp_path, kernels_key="k2") == first and other.calls > 0
    monkeypatch.setattr(calibration.cpu_isa, "cpu_model", lambda: "another CPU")
    third = FakeKernels(_cost)
    _fields(third, tmp_path)
    assert third.calls > 0 and len(list(tmp_path.glob("dispatch_calibration-*.json"))) == 3

    # a torn or foreign file is not trusted
    key = calibration_key("avx2", "k1", torch.get_num_threads())
    calibration_file(tmp_path, key).write_text("{not json")
    torn = FakeKernels(_cost)
    _fields(torn, tmp_path)
    assert torn.calls > 0


def test_a_busy_machine_times_for_this_start_only(tmp_path, monkeypatch):
    """Timed while other processes share the cores, the choice is used but not cached (auto);
    force caches it anyway."""
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    busy = calibration.BUSY_LOAD + 1
    fake = FakeKernels(_cost)
    assert _fields(fake, tmp_path, load=busy)["linear_prefetch_bytes"] == 4096
    assert not list(tmp_path.iterdir())
    again = FakeKernels(_cost)
    _fields(again, tmp_path, load=busy)
    assert again.calls > 0  # timed again
    _fields(FakeKernels(_cost), tmp_path, mode="force", load=busy)
    assert len(list(tmp_path.glob("dispatch_calibration-*.json"))) == 1


def test_a_burst_during_the_timing_is_not_cached(tmp_path, monkeypatch):
    """The load average lags: a job that starts with the timing shows only in the second look
    (after it), which alone keeps the choice out of the cache."""
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    looks = iter([0.1, calibration.BUSY_LOAD + 1, 0.1, 0.1])
    fake = FakeKernels(_cost)
    calibrated_fields(fake, "avx2", DEFAULTS, "auto", set(), tmp_path, "k1", timer=fake.clock,
                      load=lambda: next(looks))
    assert not list(tmp_path.iterdir())
    calibrated_fields(FakeKernels(_cost), "avx2", DEFAULTS, "auto", set(), tmp_path, "k1",
                      timer=fake.clock, load=lambda: next(looks))
    assert len(list(tmp_path.glob("dispatch_calibration-*.json"))) == 1


def test_machine_load_counts_the_other_processes_cpu(monkeypatch):
    """MachineLoad's second look: the machine's busy ticks since the first, less this
    process's own CPU, per usable core; BUSY_DURING of it weighs as BUSY_LOAD."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(calibration, "load_per_core", lambda: 0.0)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    hz = os.sysconf("SC_CLK_TCK")
    ticks, own = [(0, 0)], [0.0]
    monkeypatch.setattr(calibration, "_cpu_ticks", lambda: ticks[0])
    monkeypatch.setattr(calibration, "_own_cpu_seconds", lambda: own[0])
    for others_share, own_s, busy in ((0.5, 0.0, True), (0.1, 0.0, False),
                                      (0.5, 0.4 * 1000 / hz, False)):
        probe = calibration.MachineLoad()
        ticks[0], own[0] = (0, 0), 0.0
        assert probe() == 0.0  # the first look: the load average only
        ticks[0], own[0] = (int(others_share * 1000), 1000), own_s
        assert (probe() > calibration.BUSY_LOAD) == busy, (others_share, own_s)


def test_off_and_given_fields_time_nothing(tmp_path):
    fake = FakeKernels(_cost)
    assert _fields(fake, tmp_path, mode="off") == {}
    assert _fields(fake, tmp_path, given=CALIBRATED) == {}
    assert fake.calls == 0 and not list(tmp_path.iterdir())


# -- the platform and the config ---------------------------------------------------------------

def test_the_platform_applies_calibrated_and_given_values(tmp_path, monkeypatch):
    """Calibrated values reach the kernels and the table with their source; a value given in
    platform.dispatch wins over the calibration."""
    load_cpu_kernels(resolve_tier("auto"))  # loaded (built) before the cache folder moves
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "load_per_core", lambda: 0.0)
    monkeypatch.setattr(calibration, "calibrate", lambda kernels, defaults, fields, timer:
                        ({"linear_prefetch_bytes": 4096, "linear_thread_min_bytes": 0}, {}))
    platform = CpuPlatform(PlatformConfig(name="cpu", calibrate="auto",
                                          dispatch={"linear_thread_min_bytes": 131072}))
    kernels = platform.native_kernels(torch.float32)
    try:
        assert list(kernels.linear_tuning()) == [4096, 131072]
        assert (platform.dispatch.linear_prefetch_bytes,
                platform.dispatch.linear_thread_min_bytes) == (4096, 131072)
        assert platform.dispatch_sources["linear_prefetch_bytes"] == "calibrated"
        assert platform.dispatch_sources["linear_thread_min_bytes"] == "given"
        assert platform.dispatch_sources["linear_small_batch_max_rows"] == "tier"
        off = CpuPlatform(PlatformConfig(name="cpu", calibrate="off"))
        off.native_kernels(torch.float32)
        assert list(kernels.linear_tuning()) == [DEFAULTS.linear_prefetch_bytes,
                                                 DEFAULTS.linear_thread_min_bytes]
        assert set(off.dispatch_sources.values()) == {"tier"}
    finally:
        kernels.set_linear_tuning(DEFAULTS.linear_prefetch_bytes,
                                  DEFAULTS.linear_thread_min_bytes)


def test_llmkit_config_shows_each_source(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path))
    assert main(["config", "platform=cpu", "platform.calibrate=off",
                 "platform.dispatch.linear_prefetch_bytes=4096"]) == 0
    out = capsys.readouterr().out
    assert "platform.calibrate=off" in out and "given: linear_prefetch_bytes=4096" in out
    assert "tier: linear_small_batch_max_rows=8" in out

    # with a cached calibration (as a first start leaves it), config shows it as calibrated
    tier = resolve_tier("auto")
    key = calibration_key(tier, kernels_build_key(tier), len(os.sched_getaffinity(0)))
    path = calibration_file(build_directory(kernels_build_key(tier)), key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "choice": {"linear_prefetch_bytes": 1024,
                                                       "linear_thread_min_bytes": 0}}))
    assert main(["config", "platform=cpu", "platform.calibrate=auto"]) == 0
    out = capsys.readouterr().out
    assert "calibrated: linear_prefetch_bytes=1024 linear_thread_min_bytes=0" in out


@pytest.mark.parametrize("override,expected", [
    ("platform.dispatch.linear_prefetch_bytes=-1",
     "platform.dispatch.linear_prefetch_bytes: got -1"),
    ("platform.dispatch.linear_thread_min_bytes=-8",
     "platform.dispatch.linear_thread_min_bytes: got -8"),
    ("platform.calibrate=sometimes", "platform.calibrate: got 'sometimes'"),
])
def test_a_bad_value_is_a_config_error_naming_the_key(capsys, override, expected):
    assert main(["config", override]) != 0
    assert expected in capsys.readouterr().err


def test_only_speed_fields_are_calibrated():
    with pytest.raises(ValueError, match="linear_small_batch_max_rows"):
        resolve_dispatch("avx2", None, {"linear_small_batch_max_rows": 4})
    with pytest.raises(ConfigError, match="platform.calibrate"):
        calibrated_fields(SimpleNamespace(), "avx2", DEFAULTS, "sometimes", set(), None, "k")
    assert asdict(resolve_dispatch("avx2", {"linear_prefetch_bytes": 0},
                                   {"linear_prefetch_bytes": 4096}))["linear_prefetch_bytes"] == 0
