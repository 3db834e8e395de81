"""The base of every config model: unknown keys are errors (a typo fails at start-up with the
dotted key), and a component is picked by ``name`` or built from a ``_target_`` class path."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["_Component", "_Strict"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class _Component(_Strict):
    """A component picked from its registry by ``name`` or built from a ``_target_`` class path."""

    name: str
    target: str | None = Field(default=None, alias="_target_")
