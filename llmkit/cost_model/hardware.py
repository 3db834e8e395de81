"""Hardware profiles: the figures the cost model needs about one accelerator.

Profiles live in ``conf/tools/hardware/NAME.yaml`` (Hydra group ``hardware``; validated as
``llmkit.config.hardware_schema.HardwareConfig``), each value with its public source in a
comment. ``HardwareProfile`` is the plain, SI-unit form the cost model computes with (no
pydantic, so the cost model also runs where only the standard library and PyYAML are
installed).

``llmkit sim calibrate`` writes the profile it measured on this machine to
``<llmkit cache>/hardware/cpu-local.yaml`` (``default_calibration_path``); the simulator's
``hardware=cpu-local`` and ``scheduler=slo`` read that file when it exists
(``calibrated_or_shipped``), else the shipped, uncalibrated placeholder.

Three per-step terms that a CPU engine needs and a GPU profile leaves at 0 (see
``llmkit.cost_model.step_cost``): ``seq_overhead_us`` (per request in the step),
``token_overhead_us`` (per token the step computes) and ``context_overhead_ns`` (per token of
context the step's requests attend over). ``llmkit sim calibrate engine`` fits them from timed
steps of the real engine.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["CALIBRATED_NAME", "HardwareProfile", "calibrated_or_shipped",
           "default_calibration_path", "load_profile", "load_profile_yaml", "shipped_profile_path",
           "validate_profile"]

CALIBRATED_NAME = "cpu-local"


@dataclass(frozen=True)
class HardwareProfile:
    """One device, SI units (FLOP/s, bytes, bytes/s, seconds)."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    compute_efficiency: float
    memory_efficiency: float
    link_bandwidth: float = 0.0
    link_latency_s: float = 0.0
    link_efficiency: float = 1.0
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    # per request scheduled in a step, per token computed in a step, and per token of context
    # (Σ c_i) the step's requests attend over; 0 on every GPU profile
    seq_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    context_overhead_s: float = 0.0
    # engine CPU time the serving front end takes per token it streams
    # (llmkit.tools.sim.frontend_cost)
    frontend_token_s: float = 0.0
    # decode steps of up to this many rows run as a step graph; the rest pay eager_step_s more
    # (0: no step graphs modelled)
    step_graph_max_rows: int = 0
    eager_step_s: float = 0.0
    default_dtype: str = "bfloat16"
    description: str = ""
    calibrated_at: str | None = None
    source_path: str | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, cfg: Any, source_path: str | None = None) -> "HardwareProfile":
        """From a ``HardwareConfig`` or the same fields as a mapping (a profile YAML)."""
        d = cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)
        eff = d["efficiency"]
        return cls(
            name=d["name"],
            peak_flops={k: float(v) * 1e12 for k, v in d["peak_tflops"].items()},
            memory_bytes=float(d["memory_gb"]) * 1e9,
            memory_bandwidth=float(d["memory_bandwidth_gbs"]) * 1e9,
            compute_efficiency=float(eff["compute"]),
            memory_efficiency=float(eff["memory"]),
            link_bandwidth=float(d.get("link_bandwidth_gbs", 0.0)) * 1e9,
            link_latency_s=float(d.get("link_latency_us", 0.0)) * 1e-6,
            link_efficiency=float(eff.get("link", 1.0)),
            step_overhead_s=float(d.get("step_overhead_ms", 0.0)) * 1e-3,
            layer_overhead_s=float(d.get("layer_overhead_us", 0.0)) * 1e-6,
            seq_overhead_s=float(d.get("seq_overhead_us", 0.0)) * 1e-6,
            token_overhead_s=float(d.get("token_overhead_us", 0.0)) * 1e-6,
            context_overhead_s=float(d.get("context_overhead_ns", 0.0)) * 1e-9,
            frontend_token_s=float(d.get("frontend_token_us", 0.0)) * 1e-6,
            step_graph_max_rows=int(d.get("step_graph_max_rows", 0) or 0),
            eager_step_s=float(d.get("eager_step_overhead_ms", 0.0)) * 1e-3,
            default_dtype=d.get("default_dtype", "bfloat16"),
            description=d.get("description", ""),
            calibrated_at=d.get("calibrated_at"),
            source_path=source_path,
        )

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; fp8 falls back to the 16-bit rate where the device has no
        fp8 units (weights are then upcast: bytes shrink, FLOP/s do not grow)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype in ("fp8", "int8"):
            for alt in ("bfloat16", "float16"):
                if alt in self.peak_flops:
                    return self.peak_flops[alt]
        raise KeyError(f"hardware {self.name!r} lists no peak for dtype {dtype!r} (it has: "
                       f"{', '.join(self.peak_flops)})")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source_path")
        return d



def default_calibration_path() -> Path:
    from llmkit.config.paths import cache_dir
    return cache_dir() / "hardware" / f"{CALIBRATED_NAME}.yaml"


def load_profile_yaml(path: str | Path) -> dict[str, Any]:
    """A profile YAML as a plain mapping (comments dropped)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a hardware profile (expected a mapping)")
    return data


def validate_profile(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` (a profile YAML as a mapping) checked against ``HardwareConfig``; returns the
    validated mapping (what ``HardwareProfile.from_config`` takes). Raises ``ConfigError``
    naming the key."""
    from pydantic import ValidationError

    from llmkit.config.errors import ConfigError
    from llmkit.config.hardware_schema import HardwareConfig

    try:
        cfg = HardwareConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"hardware.{key}", err.get("input"),
                          f"{err['msg']} (in {where})") from None
    return cfg.model_dump()


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile file (``conf/tools/hardware/NAME.yaml`` or a calibrated one), validated."""
    return HardwareProfile.from_config(validate_profile(load_profile_yaml(path), str(path)),
                                       str(path))


def shipped_profile_path(name: str) -> Path:
    """``conf/tools/hardware/NAME.yaml`` (shipped inside the package as ``llmkit.conf``)."""
    from llmkit.config.compose import conf_dir
    return conf_dir() / "tools" / "hardware" / f"{name}.yaml"


def calibrated_or_shipped(calibrated: str | Path | None = None) -> tuple[HardwareProfile, bool]:
    """This machine's profile: the one ``llmkit sim calibrate`` wrote (``calibrated``, default
    ``default_calibration_path()``) when it exists, else the shipped ``cpu-local``
    placeholder; and whether it is the calibrated one."""
    path = Path(calibrated).expanduser() if calibrated else default_calibration_path()
    if path.is_file():
        return load_profile(path), True
    return load_profile(shipped_profile_path(CALIBRATED_NAME)), False
