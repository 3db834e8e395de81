"""Which hardware profile ``llmkit sim`` models (group ``hardware``: ``conf/tools/hardware/``).

The profile itself (``HardwareProfile``, loading and validating a file) lives below the
engine, in ``llmkit.cost_model.hardware``, since ``scheduler=slo`` prices steps with it too.
``hardware=cpu-local`` reads the profile that ``llmkit sim calibrate`` measured on this machine
when it exists (``sim.calibrate_output``, default ``<llmkit cache>/hardware/cpu-local.yaml``),
else the shipped, uncalibrated placeholder (with a warning).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from llmkit.cost_model.hardware import (CALIBRATED_NAME, HardwareProfile,
                                        default_calibration_path, load_profile)

if TYPE_CHECKING:
    from llmkit.tools.schema import SimToolConfig

__all__ = ["hardware_names", "resolve_hardware"]

logger = logging.getLogger(__name__)


def hardware_names() -> list[str]:
    from llmkit.config.compose import group_options
    from llmkit.tools.compose import TOOLS_ROOT
    return group_options("hardware", TOOLS_ROOT)


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
