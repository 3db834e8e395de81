"""A hardware profile's validated form (group ``hardware``: ``conf/tools/hardware/NAME.yaml``,
or the profile ``llmkit sim calibrate`` writes). It sits with the engine's configs because the
cost model (``llmkit.cost_model``) reads profiles for the simulator and for ``scheduler=slo``
alike."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from llmkit.config.sections.strict import _Strict

__all__ = ["HardwareConfig", "HardwareEfficiency"]


class HardwareEfficiency(_Strict):
    """Fractions of a device's peaks that real kernels reach (the simulator's cost model). Fixed
    per hardware profile, each with its public source in the profile's YAML."""

    compute: float = Field(gt=0, le=1)  # of peak_tflops, for the step's matmuls + attention
    memory: float = Field(gt=0, le=1)  # of memory_bandwidth_gbs, for weights + KV traffic
    link: float = Field(default=1.0, gt=0, le=1)  # of link_bandwidth_gbs, for all-reduce


class HardwareConfig(_Strict):
    """One accelerator as ``llmkit sim`` models it (group ``hardware``: ``conf/tools/hardware/``).

    Decimal units, as vendors print them: GB = 1e9 bytes, TFLOP/s = 1e12."""

    name: str
    description: str = ""
    # Dense peak per dtype (float32, bfloat16, float16, fp8, int8), TFLOP/s.
    peak_tflops: dict[str, float]
    memory_gb: float = Field(gt=0)
    memory_bandwidth_gbs: float = Field(gt=0)
    # Per device, per direction, for tensor-parallel all-reduce; 0 = no fast link.
    link_bandwidth_gbs: float = Field(default=0.0, ge=0)
    # Fixed cost of one all-reduce (launch + synchronisation), microseconds.
    link_latency_us: float = Field(default=0.0, ge=0)
    efficiency: HardwareEfficiency
    # Per-step costs that neither FLOPs nor bytes explain: once per step (CPU: scheduling,
    # input preparation, sampling) and once per layer (short kernels: norms, rotary, ...).
    step_overhead_ms: float = Field(default=0.0, ge=0)
    layer_overhead_us: float = Field(default=0.0, ge=0)
    # Fitted by `llmkit sim calibrate engine` on CPUs, 0 on GPU profiles: per request in a step,
    # per token computed, per token of context attended (see llmkit/cost_model/step_cost.py).
    seq_overhead_us: float = Field(default=0.0, ge=0)
    token_overhead_us: float = Field(default=0.0, ge=0)
    context_overhead_ns: float = Field(default=0.0, ge=0)
    # Where the serving front end (API server, detokenisation, and when benchmarking, the
    # client) shares the engine's CPU cores: the engine time it takes per token it streams; at
    # R tokens/s streamed a step takes 1 / (1 - R * frontend_token_us * 1e-6) as long. 0 on GPU
    # profiles. `llmkit sim calibrate engine sim.calibrate_trace=PATH` fits it to a served run.
    frontend_token_us: float = Field(default=0.0, ge=0)
    # CPU engines run decode steps of up to step_graph_max_rows rows as a compiled step graph
    # and every other step (prefill rows, more rows) eagerly; eager_step_overhead_ms is what
    # an eager step costs beyond the terms above. Fitted by `llmkit sim calibrate engine`;
    # 0 = every step priced alike (GPU profiles).
    step_graph_max_rows: int = Field(default=0, ge=0)
    eager_step_overhead_ms: float = Field(default=0.0, ge=0)
    # model.dtype=auto with a checkpoint that names no dtype
    default_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # Set by `llmkit sim calibrate` (measured on this machine); informational.
    calibrated_at: str | None = None
    # Set by `llmkit sim calibrate engine`: each timed step shape's lower-median time in ms,
    # keyed "<phase> n=<requests> T=<tokens>" ("decode b=4 ctx=128 n=4 T=4"); `llmkit plan`
    # times a few of them again to tell whether the profile still describes this machine.
    engine_steps_ms: dict[str, float] = Field(default_factory=dict)

    @field_validator("peak_tflops")
    @classmethod
    def _known_dtypes(cls, v: dict[str, float]) -> dict[str, float]:
        known = ("float32", "bfloat16", "float16", "fp8", "int8")
        for k, x in v.items():
            if k not in known:
                raise ValueError(f"dtype {k!r} is not one of: {', '.join(known)}")
            if not x > 0:
                raise ValueError(f"peak_tflops.{k} must be > 0, got {x}")
        return v
