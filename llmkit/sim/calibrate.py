"""``llmkit sim calibrate``: measure this machine and write the ``cpu-local`` hardware profile.

What is measured, with torch, each the best of a few timed repetitions after a warm-up:

- **FLOP/s per dtype** (float32, bfloat16, float16): a square ``n × n`` GEMM
  (``sim.calibrate_gemm_size``), ``2n³`` FLOPs;
- **memory bandwidth**: a ``sim.calibrate_buffer_mib`` float32 buffer summed (bytes read) and
  copied (bytes read + written); the faster of the two;
- **per-layer overhead**: the dispatch cost of a tiny torch op, times the ~15 eager ops of one
  llmkit torch decoder layer;
- **per-step overhead**: llmkit's real ``TokenBudgetScheduler`` + ``KVCacheManager``
  scheduling and updating a batch of 8 decoding requests (the control plane of one step).

The profile's peaks are *achieved* rates, so its efficiencies are 1.0. The all-reduce figures of
a CPU (gloo over shared memory) are estimates, not measurements. The file goes to
``sim.calibrate_output`` (default ``<llmkit cache>/hardware/cpu-local.yaml``), which
``hardware=cpu-local`` then reads. ``measure(device="cuda")`` measures a GPU the same way (for
checking a shipped profile's peaks × efficiencies against a real device).
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["format_calibration", "measure", "profile_yaml", "run_calibrate"]

# eager torch ops in one llmkit Llama decoder layer (2 RMSNorms, 4 projections + SiLU-mul,
# rotary, KV write, attention, 2 residual adds): an estimate of the count, not a measurement
OPS_PER_LAYER = 15
DTYPES = ("float32", "bfloat16", "float16")


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    import torch

    def run(fn: Callable[[], Any]) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run


def _best(timed: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], reps: int,
          budget_s: float) -> float:
    """The fastest of up to ``reps`` runs after one warm-up, stopping after ``budget_s``."""
    timed(fn)
    best = float("inf")
    spent = 0.0
    for _ in range(reps):
        t = timed(fn)
        best = min(best, t)
        spent += t
        if spent > budget_s:
            break
    return best


def measure_gemm(n: int, dtype: str, device: str = "cpu", reps: int = 5,
                 budget_s: float = 2.0) -> float:
    """Achieved FLOP/s of an ``n × n × n`` GEMM."""
    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dt)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dt)
    out = torch.empty(n, n, device=device, dtype=dt)
    t = _best(_timer(device), lambda: torch.matmul(a, b, out=out), reps, budget_s)
    return 2.0 * n ** 3 / t


def measure_bandwidth(buffer_mib: int, device: str = "cpu", reps: int = 5
                      ) -> dict[str, float]:
    """Bytes/s of a sum (read) and a copy (read + write) of a float32 buffer."""
    import torch

    n = buffer_mib * (1 << 20) // 4
    x = torch.ones(n, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    timed = _timer(device)
    nbytes = float(n * 4)
    t_read = _best(timed, lambda: x.sum(), reps, 5.0)
    t_copy = _best(timed, lambda: y.copy_(x), reps, 5.0)
    return {"read": nbytes / t_read, "copy": 2 * nbytes / t_copy}


def measure_op_overhead(device: str = "cpu", n: int = 2000) -> float:
    """Seconds per tiny torch op (dispatch + launch): the floor of a short kernel."""
    import torch

    a = torch.ones(16, device=device)
    o = torch.empty_like(a)

    def ops() -> None:
        for _ in range(n):
            torch.add(a, a, out=o)
    return _best(_timer(device), ops, 3, 2.0) / n


def measure_step_overhead(batch: int = 8, steps: int = 50) -> float:
    """Seconds llmkit's real scheduler + KV manager take per step for ``batch`` decoders."""
    from llmkit.config.schema import SchedulerConfig
    from llmkit.kv_cache import KVCacheManager
    from llmkit.outputs import ModelRunnerOutput
    from llmkit.request import Request
    from llmkit.sampling.params import SamplingParams
    from llmkit.scheduler import TokenBudgetScheduler

    kv = KVCacheManager(4096, 16, enable_prefix_caching=True, max_model_len=4096)
    sched = TokenBudgetScheduler(SchedulerConfig(), kv, max_model_len=4096, eos_token_id=0)
    for i in range(batch):
        sched.add_request(Request(f"r{i}", list(range(1 + i, 129 + i)),
                                  SamplingParams(max_tokens=steps + 10, ignore_eos=True)))

    def one() -> None:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids,
                                                        sampled_token_ids=[[7]] * len(ids)))
    one()  # the prefill step
    t = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - t) / steps


def _memory_bytes(device: str) -> float:
    if device.startswith("cuda"):
        import torch
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure(device: str = "cpu", gemm_size: int = 1024, buffer_mib: int = 256,
            dtypes: tuple[str, ...] = DTYPES) -> dict[str, Any]:
    """Every figure of a profile, measured on ``device`` (SI units)."""
    import torch

    flops = {dt: measure_gemm(gemm_size, dt, device) for dt in dtypes}
    bw = measure_bandwidth(buffer_mib, device)
    op_s = measure_op_overhead(device)
    step_s = measure_step_overhead()
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(0)
        default_dtype = "bfloat16"
    else:
        from llmkit.platforms.cpu import has_native_bf16
        import platform as _platform
        name = _platform.processor() or _platform.machine()
        default_dtype = "bfloat16" if has_native_bf16() else "float32"
    return {"device": device, "device_name": name, "threads": torch.get_num_threads(),
            "flops": flops, "bandwidth": bw, "op_overhead_s": op_s,
            "step_overhead_s": step_s, "memory_bytes": _memory_bytes(device),
            "default_dtype": default_dtype, "gemm_size": gemm_size, "buffer_mib": buffer_mib}


def profile_yaml(m: dict[str, Any], when: str | None = None) -> str:
    """A ``conf/hardware``-shaped YAML of measurement ``m``, each value with its source."""
    when = when or datetime.datetime.now().isoformat(timespec="seconds")
    bw = m["bandwidth"]
    best_bw = max(bw["read"], bw["copy"])
    src = f"measured by `llmkit sim calibrate` on {when}"
    lines = [
        f"# This machine ({m['device_name']}, {m['threads']} torch threads), {src}.",
        "# Peaks are achieved rates, so the efficiencies are 1.0.",
        "name: cpu-local",
        f"description: calibrated {m['device']} ({m['device_name']})",
        "peak_tflops:",
    ]
    for dt, f in m["flops"].items():
        lines.append(f"  {dt}: {f / 1e12:.6g}   # {m['gemm_size']}^3 GEMM in {dt}")
    lines += [
        f"memory_gb: {m['memory_bytes'] / 1e9:.4g}   # physical memory",
        f"memory_bandwidth_gbs: {best_bw / 1e9:.5g}   # {m['buffer_mib']} MiB float32: sum "
        f"{bw['read'] / 1e9:.4g} GB/s, copy {bw['copy'] / 1e9:.4g} GB/s (best)",
        f"link_bandwidth_gbs: {bw['copy'] / 2e9:.5g}   # estimate: all-reduce through shared "
        "memory at half the copy rate (not measured)",
        "link_latency_us: 50   # estimate: gloo's per-collective cost (not measured)",
        "efficiency:",
        "  compute: 1.0   # peaks above are achieved rates",
        "  memory: 1.0   # (measured: achieved rates)",
        "  link: 1.0   # the link figures above are estimates",
        f"step_overhead_ms: {m['step_overhead_s'] * 1e3:.4g}   # llmkit's scheduler + KV "
        "manager, one step of 8 decoding requests",
        f"layer_overhead_us: {m['op_overhead_s'] * 1e6 * OPS_PER_LAYER:.4g}   # "
        f"{OPS_PER_LAYER} eager ops x {m['op_overhead_s'] * 1e6:.3g} us per tiny torch op",
        f"default_dtype: {m['default_dtype']}",
        f"calibrated_at: '{when}'",
    ]
    return "\n".join(lines) + "\n"


def run_calibrate(cfg: Any, device: str = "cpu") -> tuple[Path, dict[str, Any]]:
    """Measure, validate (``HardwareConfig``) and write the profile; returns its path and the
    profile as a mapping."""
    import yaml

    from llmkit.config.schema import HardwareConfig
    from llmkit.platforms import resolve_platform
    from llmkit.sim.hardware import default_calibration_path

    resolve_platform(cfg.platform).apply_runtime_settings()  # the engine's thread count
    sim = cfg.sim
    m = measure(device, sim.calibrate_gemm_size, sim.calibrate_buffer_mib)
    text = profile_yaml(m)
    profile = HardwareConfig.model_validate(yaml.safe_load(text)).model_dump()
    path = Path(sim.calibrate_output).expanduser() if sim.calibrate_output else \
        default_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path, profile


def format_calibration(profile: dict[str, Any]) -> str:
    peaks = ", ".join(f"{k} {v * 1e3:.1f} GFLOP/s" for k, v in profile["peak_tflops"].items())
    return (f"{profile['description']}\n"
            f"  GEMM: {peaks}\n"
            f"  memory: {profile['memory_bandwidth_gbs']:.1f} GB/s, {profile['memory_gb']:.1f} GB\n"
            f"  overheads: {profile['step_overhead_ms']:.3f} ms per step, "
            f"{profile['layer_overhead_us']:.1f} us per layer")
