"""Platform ops (norm, rotary, activation, KV write, paged decode attention, mixture of
experts): ``base.py`` holds the interface and the torch reference; platforms supply faster
ones."""
from llmkit.ops.base import ModelOps, RotaryTables

__all__ = ["ModelOps", "RotaryTables"]
