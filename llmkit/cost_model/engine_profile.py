"""The cost model a running engine predicts its steps with (``scheduler=slo``): the model's
shape from its Hugging Face config, the engine's compute dtype and parallel sizes, and the
hardware profile ``scheduler.cost_profile`` names.

``scheduler.cost_profile``: null = the profile ``llmkit sim calibrate`` cached for this machine
(``<llmkit cache>/hardware/cpu-local.yaml``), else the shipped, uncalibrated ``cpu-local``
placeholder; a name = ``conf/tools/hardware/NAME.yaml``; a path = that profile file. The engine
says at start-up which one it uses (``describe``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from llmkit.config.errors import ConfigError
from llmkit.cost_model.hardware import (CALIBRATED_NAME, HardwareProfile, calibrated_or_shipped,
                                        default_calibration_path, load_profile,
                                        shipped_profile_path)
from llmkit.cost_model.model_shape import DTYPE_BYTES, ModelShape, ShapeError
from llmkit.cost_model.step_cost import CostModel

__all__ = ["engine_cost_model", "resolve_cost_profile"]

KEY = "scheduler.cost_profile"


def resolve_cost_profile(spec: str | None) -> tuple[HardwareProfile, str, bool]:
    """``(profile, where it came from in words, whether it was measured on this machine)``.
    Raises ``ConfigError`` naming ``scheduler.cost_profile`` for a profile that is not there."""
    if spec is None or spec == CALIBRATED_NAME:
        profile, calibrated = calibrated_or_shipped()
        if calibrated:
            return profile, f"the calibrated profile {profile.source_path}", True
        return profile, (f"the shipped, uncalibrated {CALIBRATED_NAME} profile (no "
                         f"{default_calibration_path()}: run `llmkit sim calibrate engine` to "
                         "measure this machine)"), False
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(KEY, spec, "null, a profile name or an existing profile YAML "
                              "file (this one does not exist)")
        return load_profile(path), f"the profile {path}", True
    path = shipped_profile_path(spec)
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(KEY, spec, "null, a YAML path or one of: " + ", ".join(names))
    return load_profile(path), f"the profile {spec} ({path})", False


def engine_cost_model(hf_config: Any, profile: HardwareProfile, dtype: str, *,
                      name: str = "model", tensor_parallel_size: int = 1,
                      pipeline_parallel_size: int = 1) -> CostModel:
    """The cost model of this engine's steps (``dtype``: its compute dtype, torch's name or
    plain). Raises ``ConfigError`` when the model's config lacks what the model needs."""
    dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        dtype = profile.default_dtype
    try:
        shape = ModelShape.from_hf_config(hf_config, name=name)
        return CostModel(shape, profile, dtype, tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size)
    except (ShapeError, KeyError, ValueError) as e:
        raise ConfigError("scheduler.name", "slo", "", message=(
            f"the cost model cannot price this model's steps ({e}); use "
            "scheduler=token_budget")) from None
