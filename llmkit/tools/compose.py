"""The tools' config root: ``conf/tools/tools.yaml`` composes the engine's root
(``conf/config.yaml``) and adds the tools' sections (``bench``, ``sim``, ``plan``,
``eval``, ``proxy``) and groups (``hardware``: ``conf/tools/hardware/``). The engine's root names
none of them; ``llmkit bench|sim|plan|eval|proxy`` and ``llmkit config`` compose this one.

- ``compose_tool_config(tool, overrides)``: the CLI's path, Hydra overrides only.
- ``build_tool_config(tool, model, dtype=, overrides=, groups=)``: ``build_config``'s path.

Both return the tool's config class (``BenchToolConfig``, ``SimToolConfig``, ...): the engine's
config inside, the tool's sections beside it. Every composition validates every tool's
sections, so a ``bench.*`` key fails the same way under ``llmkit sim`` as under ``bench``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar, cast

from llmkit.config.compose import ConfigRoot, build_document, compose_document
from llmkit.tools.schema import ToolConfig, ToolsConfig

__all__ = ["TOOLS_ROOT", "build_tool_config", "compose_tool_config"]

T = TypeVar("T", bound=ToolConfig)

#: ``conf/tools/tools.yaml``, validated as ``ToolsConfig``; its own groups sit beside it.
TOOLS_ROOT = ConfigRoot("tools", "tools", ToolsConfig)


def compose_tool_config(tool: type[T], overrides: Sequence[str] = ()) -> T:
    """The tools' root with Hydra overrides, as ``tool``'s config. Raises ``ConfigError``."""
    return cast(ToolsConfig, compose_document(overrides, TOOLS_ROOT)).tool_config(tool)


def build_tool_config(tool: type[T], model: str | None = None, *, dtype: str | None = None,
                      overrides: Sequence[str] = (),
                      groups: Mapping[str, str | Mapping] | None = None) -> T:
    """``llmkit.config.compose.build_config`` over the tools' root, as ``tool``'s config."""
    doc = build_document(TOOLS_ROOT, model, dtype=dtype, overrides=overrides, groups=groups)
    return cast(ToolsConfig, doc).tool_config(tool)
