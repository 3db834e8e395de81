"""Registry[T]: one per component kind. An implementation is found by a registered name, by a
``llmkit.<kind>`` entry point (or the group a registry names) of another package, or by a ``_target_`` class path."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class UnknownImplementation(LookupError):
    """Raised with the kind, the asked name and the registered names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"{kind}: {name!r} is not registered; registered: {', '.join(known)}")


class Registry(Generic[T]):
    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group or f"llmkit.{kind}"
        self._entries: dict[str, Callable[[], type[T]] | type[T]] = {}
        self._entry_points_loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            self._entries[name] = cls
            return cls
        return deco

    def register_lazy(self, name: str, class_path: str) -> None:
        """Register by dotted path so that heavy modules load only when picked."""
        self._entries[name] = lambda: import_class(class_path)

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            self._entries.setdefault(ep.name, ep.load)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load_entry_points()
        return name in self._entries

    def get(self, name: str) -> type[T]:
        self._load_entry_points()
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownImplementation(self.kind, name, self.names())
        if isinstance(entry, type):
            return entry
        cls = entry()
        self._entries[name] = cls
        return cls

    def resolve(self, name: str | None, target: str | None) -> type[T]:
        """The class for a config: ``_target_`` wins over ``name``."""
        if target:
            return import_class(target)
        if name is None:
            raise UnknownImplementation(self.kind, "<none>", self.names())
        return self.get(name)


def import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted class path (package.module.Class)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import {module_name!r} for {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{module_name!r} has no attribute {attr!r}") from None
