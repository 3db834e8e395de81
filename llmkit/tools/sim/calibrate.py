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

``llmkit sim calibrate engine [key=value ...]`` (or ``llmkit sim calibrate MODEL ...``) does the
above and then times the real engine (the configured model, default the SmolLM2 preset) on steps
of known shapes and fits the efficiencies and overheads to them
(``llmkit.tools.sim.engine_measure``, ``engine_fit``), writing the fitted terms, with the model,
date and fit error in comments, into the same file. With ``sim.calibrate_trace=PATH`` (the step
trace of ``llmkit serve`` running the same model under load) it also fits what the serving front
end costs the engine per token it streams (``llmkit.tools.sim.frontend_cost``).
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["format_calibration", "measure", "profile_yaml", "run_calibrate",
           "run_engine_calibrate"]

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
            dtypes: tuple[str, ...] = DTYPES, gemm_sizes: dict[str, int] | None = None
            ) -> dict[str, Any]:
    """Every figure of a profile, measured on ``device`` (SI units). ``gemm_sizes``: a GEMM size
    per dtype where it differs from ``gemm_size``."""
    import torch

    sizes = {dt: (gemm_sizes or {}).get(dt, gemm_size) for dt in dtypes}
    flops = {dt: measure_gemm(sizes[dt], dt, device) for dt in dtypes}
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
            "default_dtype": default_dtype, "gemm_size": gemm_size, "gemm_sizes": sizes,
            "buffer_mib": buffer_mib}


def profile_yaml(m: dict[str, Any], when: str | None = None, engine: Any = None,
                 frontend: Any = None) -> str:
    """A ``conf/tools/hardware``-shaped YAML of measurement ``m``, each value with its source.
    ``engine``: ``(EngineMeasurement, EngineFit)`` of ``llmkit sim calibrate engine``, whose
    fitted efficiencies and overheads then replace the microbenchmark's; ``frontend``: its
    ``FrontendFit`` from a served run's trace."""
    when = when or datetime.datetime.now().isoformat(timespec="seconds")
    bw = m["bandwidth"]
    best_bw = max(bw["read"], bw["copy"])
    sizes = m.get("gemm_sizes") or {}
    command = "llmkit sim calibrate engine" if engine is not None else "llmkit sim calibrate"
    src = f"measured by `{command}` on {when}"
    lines = [f"# This machine ({m['device_name']}, {m['threads']} torch threads), {src}."]
    if engine is None:
        lines.append("# Peaks are achieved rates, so the efficiencies are 1.0.")
        description = f"calibrated {m['device']} ({m['device_name']})"
    else:
        meas, fit = engine
        lines += [
            "# Peaks and bandwidth: torch microbenchmarks (achieved rates). Efficiencies and "
            "overheads:",
            f"# fitted to {len(meas.samples)} timed steps ({len(fit.groups)} shapes) of the "
            f"real engine running {meas.model_name}",
            f"# ({meas.dtype}, {meas.attention}, {meas.threads} threads): fit error RMS "
            f"{100 * fit.rms_rel_error:.1f}%, max {100 * fit.max_rel_error:.1f}%"
            + (f" ({fit.num_outliers} outlier shapes left out)" if fit.num_outliers else "")
            + "; table at the end.",
            f"# They describe this engine build on this machine: re-run `{command}` after "
            "either changes.",
        ]
        description = (f"calibrated {m['device']} ({m['device_name']}) from engine steps of "
                       f"{meas.model_name} ({meas.dtype})")
    lines += ["name: cpu-local", f"description: {description}", "peak_tflops:"]
    fit = engine[1] if engine is not None else None
    for dt, f in m["flops"].items():
        gemm = f"{sizes.get(dt, m['gemm_size'])}^3 GEMM in {dt}"
        if fit is not None and dt == fit.dtype and fit.profile.peak(dt) > f * (1 + 1e-4):
            lines.append(f"  {dt}: {fit.profile.peak(dt) / 1e12:.6g}   # the rate the engine's "
                         f"steps imply, above the {gemm} ({f / 1e12:.4g})")
        else:
            lines.append(f"  {dt}: {f / 1e12:.6g}   # {gemm}")
    bw_src = (f"{m['buffer_mib']} MiB float32: sum {bw['read'] / 1e9:.4g} GB/s, copy "
              f"{bw['copy'] / 1e9:.4g} GB/s")
    if fit is not None and fit.profile.memory_bandwidth > best_bw * (1 + 1e-4):
        bw_line = (f"memory_bandwidth_gbs: {fit.profile.memory_bandwidth / 1e9:.6g}   # the "
                   f"rate the engine's steps imply, above the microbenchmark ({bw_src})")
    else:
        bw_line = f"memory_bandwidth_gbs: {best_bw / 1e9:.5g}   # {bw_src} (best)"
    lines += [
        f"memory_gb: {m['memory_bytes'] / 1e9:.4g}   # physical memory",
        bw_line,
        f"link_bandwidth_gbs: {bw['copy'] / 2e9:.5g}   # estimate: all-reduce through shared "
        "memory at half the copy rate (not measured)",
        "link_latency_us: 50   # estimate: gloo's per-collective cost (not measured)",
        "efficiency:",
    ]
    if engine is None:
        lines += [
            "  compute: 1.0   # peaks above are achieved rates",
            "  memory: 1.0   # (measured: achieved rates)",
            "  link: 1.0   # the link figures above are estimates",
            f"step_overhead_ms: {m['step_overhead_s'] * 1e3:.4g}   # llmkit's scheduler + KV "
            "manager, one step of 8 decoding requests",
            f"layer_overhead_us: {m['op_overhead_s'] * 1e6 * OPS_PER_LAYER:.4g}   # "
            f"{OPS_PER_LAYER} eager ops x {m['op_overhead_s'] * 1e6:.3g} us per tiny torch op",
        ]
    else:
        meas, fit = engine
        lines += [
            f"  compute: {fit.compute_efficiency:.6g}   # fitted: engine steps vs their FLOPs at "
            f"the {meas.dtype} peak above",
            f"  memory: {fit.memory_efficiency:.6g}   # fitted: engine steps vs their weight + "
            "KV bytes at the bandwidth above",
            "  link: 1.0   # the link figures above are estimates",
            f"step_overhead_ms: {fit.step_overhead_s * 1e3:.6g}   # fitted per-step constant, "
            f"up to the measured control plane ({m['step_overhead_s'] * 1e3:.3g} ms: "
            "scheduler + KV manager)",
            f"layer_overhead_us: {fit.layer_overhead_s * 1e6:.6g}   # fitted: the rest of the "
            f"per-step constant, over {meas.shape.num_layers} layers",
            f"seq_overhead_us: {fit.seq_s * 1e6:.6g}   # fitted: per request in a step",
            f"token_overhead_us: {fit.token_s * 1e6:.6g}   # fitted: per token computed in a "
            "step",
            f"context_overhead_ns: {fit.context_s * 1e9:.6g}   # fitted: per token of context "
            "attended in a step",
            f"step_graph_max_rows: {fit.graph_rows}   # the engine's decode step graphs' rows "
            "(0: none, or no eager cost found)",
            f"eager_step_overhead_ms: {fit.eager_s * 1e3:.6g}   # fitted: per step the engine "
            "runs eagerly (prefill rows, or more rows than its step graphs)",
        ]
        if frontend is not None:
            lines.append(
                f"frontend_token_us: {frontend.token_s * 1e6:.6g}   # fitted: {frontend.num_steps} "
                f"served steps ({frontend.trace}, {frontend.mean_rate:.1f} tokens/s streamed) "
                f"took {100 * frontend.excess:+.1f}% over the engine alone")
        else:
            lines.append("frontend_token_us: 0   # not measured: pass sim.calibrate_trace=PATH "
                         "(a served run's step trace)")
    lines += [f"default_dtype: {m['default_dtype']}", f"calibrated_at: '{when}'"]
    if engine is not None:
        meas, fit = engine
        # what `llmkit plan` times again to tell whether this profile still holds here
        lines.append("engine_steps_ms:   # each shape's lower-median step, as timed here")
        lines += [f'  "{g.key}": {1e3 * g.seconds:.6g}' for g in fit.groups]
        lines.append(f"# Engine steps, each shape's lower-median time vs this profile "
                     f"(n requests, T tokens, C context; {meas.measure_s:.0f} s):")
        lines += [f"#   {row}" for row in fit.table()]
        if meas.skipped:
            lines.append(f"# skipped (time budget): {', '.join(meas.skipped)}")
    return "\n".join(lines) + "\n"


def _write_profile(cfg: Any, text: str) -> tuple[Path, dict[str, Any]]:
    """Validate ``text`` and write it to ``sim.calibrate_output`` (atomically)."""
    import yaml

    from llmkit.cost_model.hardware import default_calibration_path, validate_profile

    sim = cfg.sim
    path = Path(sim.calibrate_output).expanduser() if sim.calibrate_output else \
        default_calibration_path()
    profile = validate_profile(yaml.safe_load(text), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path, profile


def run_calibrate(cfg: Any, device: str = "cpu") -> tuple[Path, dict[str, Any]]:
    """Measure, validate (``HardwareConfig``) and write the profile; returns its path and the
    profile as a mapping."""
    from llmkit.platforms import resolve_platform

    resolve_platform(cfg.engine.platform).apply_runtime_settings()  # the engine's threads
    sim = cfg.sim
    m = measure(device, sim.calibrate_gemm_size, sim.calibrate_buffer_mib)
    return _write_profile(cfg, profile_yaml(m))


def run_engine_calibrate(cfg: Any, *, log: Callable[[str], None] | None = None,
                         **measure_kw: Any) -> tuple[Path, dict[str, Any], Any, Any]:
    """``llmkit sim calibrate engine``: the microbenchmarks, then the real engine of ``cfg``
    timed and fitted (``llmkit.tools.sim.engine_fit``); writes the profile. Returns its path, the
    profile as a mapping, the ``EngineFit`` and the ``EngineMeasurement`` (``measure_kw`` go to
    ``measure_engine``)."""
    import yaml

    from llmkit.cost_model.hardware import HardwareProfile
    from llmkit.platforms import resolve_platform
    from llmkit.tools.sim.engine_fit import fit_engine, group_samples
    from llmkit.tools.sim.engine_measure import engine_dtype, measure_engine

    log = log or (lambda s: None)
    resolve_platform(cfg.engine.platform).apply_runtime_settings()  # the engine's threads
    sim = cfg.sim
    if sim.calibrate_trace:
        from llmkit.tools.sim.frontend_cost import trace_steps

        trace_steps(sim.calibrate_trace)  # a bad file fails now, not after the measurements
    dtype = engine_dtype(cfg.engine)
    # the engine's dtype at the configured size; the others smaller (a CPU without native
    # bf16 runs a 1024^3 bf16 GEMM for seconds, and the engine fit does not use them)
    small = min(sim.calibrate_gemm_size, 512)
    t0 = time.perf_counter()
    m = measure("cpu", sim.calibrate_gemm_size, sim.calibrate_buffer_mib,
                gemm_sizes={dt: small for dt in DTYPES if dt != dtype})
    log(f"microbenchmarks: {dtype} GEMM {m['flops'].get(dtype, 0) / 1e9:.1f} GFLOP/s, "
        f"memory {max(m['bandwidth'].values()) / 1e9:.1f} GB/s "
        f"({time.perf_counter() - t0:.1f} s)")
    base = HardwareProfile.from_config(yaml.safe_load(profile_yaml(m)))
    meas = measure_engine(cfg, log=log, **measure_kw)
    if meas.dtype not in base.peak_flops:
        raise ValueError(f"the engine ran {meas.dtype}, which the microbenchmarks did not "
                         f"measure ({', '.join(base.peak_flops)})")
    groups = group_samples(meas.samples)
    fit = fit_engine(meas.shape, meas.dtype, base, groups,
                     control_plane_s=m["step_overhead_s"], graph_rows=meas.graph_rows)
    frontend = None
    if sim.calibrate_trace:
        from llmkit.tools.sim.frontend_cost import frontend_cost_from_trace

        frontend = frontend_cost_from_trace(sim.calibrate_trace, meas.shape, fit.profile,
                                            meas.dtype)
        log(f"served steps ({frontend.num_steps} in {frontend.trace}, {frontend.mean_rate:.1f} "
            f"tokens/s streamed) took {100 * frontend.excess:+.1f}% over the engine-alone "
            f"model: the front end costs {frontend.token_s * 1e6:.0f} us of engine time per "
            "token streamed")
    path, profile = _write_profile(cfg, profile_yaml(m, engine=(meas, fit),
                                                     frontend=frontend))
    return path, profile, fit, meas


def format_calibration(profile: dict[str, Any]) -> str:
    peaks = ", ".join(f"{k} {v * 1e3:.1f} GFLOP/s" for k, v in profile["peak_tflops"].items())
    eff = profile["efficiency"]
    text = (f"{profile['description']}\n"
            f"  GEMM: {peaks}\n"
            f"  memory: {profile['memory_bandwidth_gbs']:.1f} GB/s, {profile['memory_gb']:.1f} GB\n"
            f"  efficiencies: compute {eff['compute']:.3g}, memory {eff['memory']:.3g}\n"
            f"  overheads: {profile['step_overhead_ms']:.3f} ms per step, "
            f"{profile['layer_overhead_us']:.1f} us per layer")
    extra = [(profile.get("seq_overhead_us"), "us per request"),
             (profile.get("token_overhead_us"), "us per token"),
             (profile.get("context_overhead_ns"), "ns per context token")]
    if any(v for v, _ in extra):
        text += ", " + ", ".join(f"{v or 0:.4g} {unit}" for v, unit in extra)
    if profile.get("frontend_token_us"):
        text += (f"\n  serving front end: {profile['frontend_token_us']:.4g} us of engine time "
                 "per token streamed")
    return text
