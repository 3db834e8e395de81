"""``PlanError``: a plan failure that is the user's to fix (``llmkit plan`` prints its one line
and exits with its code)."""
from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(Exception):
    """A plan failure that is the user's to fix: one line."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
