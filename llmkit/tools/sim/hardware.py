"""Hardware profiles: the figures the cost model needs about one accelerator.

Profiles live in ``conf/tools/hardware/NAME.yaml`` (Hydra group ``hardware``; validated as
``llmkit.tools.schema.HardwareConfig``), each value with its public source in a comment.
``HardwareProfile`` is the plain, SI-unit form the cost model computes with (no pydantic, so the
cost model also runs where only the standard library and PyYAML are installed).

``hardware=cpu-local`` reads the profile that ``llmkit sim calibrate`` measured on this machine
when it exists (``sim.calibrate_output``, default ``<llmkit cache>/hardware/cpu-local.yaml``),
else the shipped, uncalibrated placeholder (with a warning).

Three per-step terms that a CPU engine needs and a GPU profile leaves at 0 (see
``llmkit.tools.sim.cost_model``): ``seq_overhead_us`` (per request in the step),
``token_overhead_us`` (per token the step computes) and ``context_overhead_ns`` (per token of
context the step's requests attend over). ``llmkit sim calibrate engine`` fits them from timed
steps of the real engine. They are read from a profile file (``resolve_hardware``,
``load_profile``) beside the ``HardwareConfig`` fields; when ``HardwareConfig`` has no field of
that name they are validated here (numbers >= 0) and kept out of its strict validation.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from llmkit.tools.schema import SimToolConfig

__all__ = ["CALIBRATED_NAME", "HardwareProfile", "default_calibration_path",
           "hardware_names", "load_profile", "load_profile_yaml", "resolve_hardware",
           "validate_profile"]

logger = logging.getLogger(__name__)

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


def hardware_names() -> list[str]:
    from llmkit.config.compose import group_options
    from llmkit.tools.compose import TOOLS_ROOT
    return group_options("hardware", TOOLS_ROOT)


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
    from llmkit.tools.schema import HardwareConfig

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


def resolve_hardware(cfg: SimToolConfig) -> HardwareProfile:
    """The profile ``cfg`` simulates: ``cfg.hardware``, or for ``cpu-local`` the calibrated
    file when there is one."""
    from llmkit.config.errors import ConfigError

    hw = cfg.hardware
    if hw is None:
        raise ConfigError("hardware", None, "a profile: " + ", ".join(hardware_names()))
    if hw.name == CALIBRATED_NAME:
        out = cfg.sim.calibrate_output
        path = Path(out).expanduser() if out else default_calibration_path()
        if path.is_file():
            logger.info("hardware=cpu-local: using the calibrated profile %s", path)
            return load_profile(path)
        logger.warning("hardware=cpu-local is not calibrated (no %s): using the shipped "
                       "placeholder figures; run `llmkit sim calibrate` to measure this machine",
                       path)
    return HardwareProfile.from_config(hw)
