"""Compose an ``EngineConfig`` from ``conf/`` (Hydra) plus overrides, and turn every failure into
a one-line ``ConfigError`` (dotted key, value, what is allowed).

- ``compose_config(overrides)``: the CLI's path — Hydra overrides only.
- ``build_config(model, dtype=, overrides=, groups=)``: the Python API's path (``LLM(...)``).
- ``compose_document`` / ``build_document``: the same for any ``ConfigRoot`` — a primary config
  and the model its whole document validates against. The engine's root is ``ENGINE_ROOT``
  (``conf/config.yaml``, ``EngineConfig``); the tools' (``llmkit.tools.compose.TOOLS_ROOT``,
  ``conf/tools/``) composes the engine's root and adds the tools' sections and groups.
- ``config_to_yaml(cfg)``: what ``llmkit config`` prints.

Every composition validates its whole document, so an unknown key fails with the keys its
section has.

``recipes/*.yaml`` form the Hydra group ``recipe`` (default null): they are registered into
Hydra's ConfigStore under that group with package ``_global_`` before each composition.
``recipe=PATH`` (a value ending in ``.yaml``/``.yml`` or holding a ``/``) loads a YAML file
anywhere (``llmkit plan`` writes them): it is registered the same way under a name of its own,
and ``EngineConfig.recipe`` keeps the path as given.

Failures are put into words by ``llmkit.config.hydra_errors`` (Hydra, OmegaConf) and
``llmkit.config.schema_errors`` (pydantic validation).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel

from llmkit.config.errors import ConfigError
from llmkit.config.hydra_errors import first_line, hydra_error_to_config_error, parse_override
from llmkit.config.schema import EngineConfig
from llmkit.config.schema_errors import (model_at, validate_document,
                                         validation_error_to_config_error)

__all__ = [
    "ENGINE_ROOT",
    "ConfigRoot",
    "build_config",
    "build_document",
    "compose_config",
    "compose_document",
    "config_to_yaml",
    "conf_dir",
    "config_groups",
    "expand_overrides",
    "group_options",
    "is_recipe_path",
    "model_presets",
    "recipes_dir",
    "resolve_model_arg",
    "validation_error_to_config_error",
]

RECIPE_GROUP = "recipe"
# Hydra's GlobalHydra and ConfigStore are process-wide: one composition at a time.
_LOCK = threading.RLock()


# --------------------------------------------------------------------------- where conf/ lives
# Whatever reads recipes_dir() stays in this module: tests swap in their own recipes by
# patching this module's recipes_dir.

def _package_dir(package: str, repo_name: str) -> Path:
    """The directory of ``llmkit.<package>``: the repository's top-level ``<repo_name>/`` when
    running from a checkout, else the installed package (found with importlib.resources)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / repo_name / "__init__.py").is_file():
        return root / repo_name
    try:
        found = importlib.resources.files(f"llmkit.{package}")
        path = Path(str(found))
        if path.is_dir():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    path = Path(__file__).resolve().parents[1] / package
    if path.is_dir():
        return path
    raise RuntimeError(f"cannot find llmkit's {package}/ directory (looked in {root} and the "
                       "installed package llmkit.{package}); is llmkit installed correctly?")


@functools.cache
def conf_dir() -> Path:
    """The Hydra config directory (``conf/`` in a checkout, ``llmkit/conf`` when installed)."""
    return _package_dir("conf", "conf")


@functools.cache
def recipes_dir() -> Path:
    """The recipes directory (``recipes/`` in a checkout, ``llmkit/recipes`` when installed)."""
    return _package_dir("recipes", "recipes")


@dataclass(frozen=True)
class ConfigRoot:
    """A primary config and what its composed document validates against.

    ``folder``: where the primary config ``name``.yaml and the root's own groups live, under
    ``conf/`` ("" = ``conf/`` itself); a root in a sub-folder composes the engine's root too,
    so ``conf/``'s groups are found after its own. ``not_groups``: folders of ``conf/`` that
    are another root's, not groups of this one."""

    name: str
    folder: str
    schema: type[BaseModel]
    not_groups: frozenset[str] = frozenset()

    def dirs(self) -> list[Path]:
        """Hydra's search path: the root's folder, then (for a sub-folder) ``conf/``."""
        return [conf_dir() / self.folder, conf_dir()] if self.folder else [conf_dir()]

    def is_group(self, folder: str) -> bool:
        """Whether a folder on the search path is a group (not this root's own or another's)."""
        return folder not in self.not_groups and folder != self.folder


#: The engine's root: ``conf/config.yaml``, validated as ``EngineConfig``. ``conf/tools/`` is
#: the tools' root (``llmkit.tools.compose``), no group of the engine's.
ENGINE_ROOT = ConfigRoot("config", "", EngineConfig, frozenset({"tools"}))


def group_options(group: str, root: ConfigRoot = ENGINE_ROOT) -> list[str]:
    """The option names of a config group (its yaml files; for ``recipe``: the recipes)."""
    if group == RECIPE_GROUP:
        return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    for d in root.dirs():
        if root.is_group(group) and (d / group).is_dir():
            return sorted(p.stem for p in (d / group).glob("*.yaml"))
    return []


def _groups(root: ConfigRoot = ENGINE_ROOT) -> list[str]:
    found = {p.name for d in root.dirs() for p in d.iterdir()
             if p.is_dir() and root.is_group(p.name) and any(p.glob("*.yaml"))}
    return sorted(found | {RECIPE_GROUP})


def config_groups(root: ConfigRoot = ENGINE_ROOT) -> list[str]:
    """The config groups a command line can pick from (the root's folders and ``recipe``)."""
    return _groups(root)


def model_presets() -> list[str]:
    return group_options("model")


# --------------------------------------------------------------------------- Hydra plumbing

def _store_recipe(path: Path, name: str) -> None:
    """Register one recipe file in Hydra's ConfigStore (group ``recipe``, as ``name``), in the
    package its ``# @package`` header names (default ``_global_``)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    package = "_global_"
    for line in path.read_text().splitlines():
        m = re.match(r"\s*#\s*@package\s+(\S+)", line)
        if m:
            package = m.group(1)
            break
        if line.strip() and not line.lstrip().startswith("#"):
            break
    node = OmegaConf.load(path)
    ConfigStore.instance().store(group=RECIPE_GROUP, name=name, node=node, package=package,
                                 provider="llmkit")


def _register_recipes() -> None:
    for path in sorted(recipes_dir().glob("*.yaml")):
        _store_recipe(path, path.stem)


def is_recipe_path(value: object) -> bool:
    """Whether a ``recipe`` value names a file rather than a recipe in ``recipes/``."""
    return isinstance(value, str) and (value.endswith((".yaml", ".yml")) or "/" in value)


def _recipe_file(value: str) -> Path:
    """The recipe file ``recipe=PATH`` names; a ``ConfigError`` naming ``recipe`` if it is
    missing."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(RECIPE_GROUP, value, "a recipe name ("
                          + ", ".join(group_options(RECIPE_GROUP))
                          + ") or the path of a YAML file that exists")
    return path.resolve()


def _file_recipe_name(path: Path) -> str:
    # A ConfigStore name of its own per file: no '/' (a name is a path in Hydra's repository)
    # and no clash with recipes/'s names.
    return f"file-{path.stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def _file_recipe_overrides(overrides: Sequence[str]
                           ) -> tuple[list[str], dict[str, tuple[Path, str]]]:
    """``recipe=PATH`` overrides rewritten to the name each file is registered under, and
    ``{name: (file, the value as given)}``."""
    out: list[str] = []
    files: dict[str, tuple[Path, str]] = {}
    for text in overrides:
        ov = parse_override(text)
        if (ov.key_or_group == RECIPE_GROUP and not ov.is_sweep_override()
                and not ov.is_delete() and is_recipe_path(ov.value())):
            path = _recipe_file(ov.value())
            name = _file_recipe_name(path)
            files[name] = (path, ov.value())
            text = f"{RECIPE_GROUP}={name}"
        out.append(text)
    return out, files


@contextlib.contextmanager
def _hydra_context(root: ConfigRoot) -> Iterator[None]:
    """``initialize_config_dir`` around one composition; works many times in one process and
    inside a running Hydra app (whose global state is put back afterwards)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.version import VersionBase

    gh = GlobalHydra.instance()
    saved_hydra = gh.hydra
    saved_base = VersionBase.instance().version_base
    gh.clear()
    try:
        with initialize_config_dir(config_dir=str(root.dirs()[0]), version_base=None,
                                   job_name="llmkit"):
            yield
    finally:
        GlobalHydra.instance().hydra = saved_hydra
        VersionBase.instance().version_base = saved_base


def _check_overrides(overrides: Sequence[str], root: ConfigRoot, *,
                     allow_sweeps: bool = False) -> None:
    """Parse each override; check group options ourselves for a clear message."""
    groups = set(_groups(root))
    for text in overrides:
        if not isinstance(text, str):
            raise ConfigError("overrides", text, "strings like key=value")
        ov = parse_override(text)
        key = ov.key_or_group
        if ov.is_sweep_override() and not allow_sweeps:
            raise ConfigError(key, text.partition("=")[2],
                              "a single value (key=[a,b] for a list, key='a,b' for a string, "
                              "or -m to sweep over the values)")
        if ov.is_delete() or key not in groups or ov.package is not None:
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        options = group_options(key, root)
        for value in values:
            if key == RECIPE_GROUP and (value is None or is_recipe_path(value)):
                if value is not None:
                    _recipe_file(value)
                continue
            if not isinstance(value, str) or value not in options:
                raise ConfigError(key, value, _options_text(key, options))


def _options_text(group: str, options: Sequence[str]) -> str:
    text = ", ".join(options)
    if group == "model":
        text += " (or model.path=PATH for an HF model folder or a .gguf file)"
    return text


def expand_overrides(overrides: Sequence[str], root: ConfigRoot = ENGINE_ROOT
                     ) -> list[list[str]]:
    """Expand sweeps (``key=a,b``, ``choice(...)``, ``range(...)``) into the cartesian product of
    plain override lists, as Hydra's basic sweeper (``-m``) does."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    overrides = list(overrides)
    _check_overrides(overrides, root, allow_sweeps=True)
    parsed = [parse_override(o) for o in overrides]
    try:
        return BasicSweeper.split_arguments(parsed, None)[0]
    except Exception as e:  # e.g. an interval sweep, which the basic sweeper cannot expand
        key = parsed[0].key_or_group if parsed else ""
        raise ConfigError(key, None, "", message=first_line(str(e))) from None


def _hydra_error(e: Exception, overrides: Sequence[str], root: ConfigRoot = ENGINE_ROOT
                 ) -> ConfigError:
    """A Hydra/OmegaConf failure as one ConfigError line."""
    return hydra_error_to_config_error(e, overrides, lambda g: group_options(g, root),
                                       root.schema)


# --------------------------------------------------------------------------- composition

def _searchpath_override(dirs: Sequence[Path]) -> str:
    quoted = ["'file://" + str(d).replace("'", "\\'") + "'" for d in dirs]
    return f"hydra.searchpath=[{','.join(quoted)}]"


def _compose_dict(overrides: Sequence[str], root: ConfigRoot) -> dict:
    """Hydra-compose ``root``'s primary config with ``overrides`` into a plain dict
    (resolved)."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides)
    _check_overrides(overrides, root)
    given = overrides
    overrides, files = _file_recipe_overrides(overrides)
    # a root in a sub-folder finds the engine's root and groups on Hydra's search path (quoted:
    # an install path may hold '=', ',' or spaces, as pip's cache folders do)
    search = [_searchpath_override(root.dirs()[1:])] if root.folder else []
    try:
        with _LOCK, _hydra_context(root):
            _register_recipes()
            for name, (path, _) in files.items():
                _store_recipe(path, name)
            cfg = compose(config_name=root.name, overrides=[*search, *overrides],
                          return_hydra_config=True)
        choices = cfg.hydra.runtime.choices
        recipe = choices.get(RECIPE_GROUP)
        with open_dict(cfg):
            del cfg["hydra"]
        data = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise _hydra_error(e, given, root) from None
    if recipe in files:  # the path as given, not the name it was registered under
        recipe = files[recipe][1]
    if recipe not in (None, "null"):
        data[RECIPE_GROUP] = recipe
    return data


def compose_config(overrides: Sequence[str] = ()) -> EngineConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides and validate it.

    Raises ``ConfigError`` (one line: dotted key, value, what is allowed) on any failure.
    """
    return cast(EngineConfig, compose_document(overrides, ENGINE_ROOT))


def compose_document(overrides: Sequence[str], root: ConfigRoot) -> BaseModel:
    """``compose_config`` for any root: its primary config with Hydra overrides, validated
    as ``root.schema``."""
    if isinstance(overrides, str):
        overrides = [overrides]
    return validate_document(_compose_dict(overrides, root), root.schema)


def resolve_model_arg(model: str) -> tuple[list[str], dict]:
    """A preset name (``conf/model/NAME.yaml``) → ``(["model=NAME"], {})``; else a path →
    ``(["model=custom"], {"model": {"path": ABS}})``. A path that does not exist, or a file that
    is not a ``.gguf``, raises ``ConfigError`` naming ``model.path``."""
    presets = model_presets()
    if model in presets:
        return [f"model={model}"], {}
    path = Path(model).expanduser()
    allowed = ("an HF model folder or a .gguf file that exists, or a preset: "
               + ", ".join(p for p in presets if p != "custom"))
    if not path.exists():
        raise ConfigError("model.path", str(model), allowed)
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ConfigError("model.path", str(model), allowed)
    return ["model=custom"], {"model": {"path": str(path.resolve())}}


def _deep_merge(base: dict, extra: Mapping) -> dict:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = _plain(v)
    return base


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def build_config(model: str | None = None, *, dtype: str | None = None,
                 overrides: Sequence[str] = (),
                 groups: Mapping[str, str | Mapping] | None = None,
                 quantization: str | None = None) -> EngineConfig:
    """The Python API's config: ``LLM(model, dtype=..., scheduler={...}, attention="triton",
    overrides=[...])``.

    - ``model``: a preset name (``conf/model/NAME.yaml``) or a path (made absolute).
    - ``groups``: a ``str`` selects a group's yaml (``attention="triton"``, ``recipe="cpu-chat"``);
      a mapping merges its fields into that section (after composition, before validation);
      a plain value sets a top-level key (``seed=3``).
    - ``dtype`` sets ``model.dtype``, ``quantization`` ``model.quantization`` (vLLM's names).
    Order: Hydra composition (group choices, ``overrides``), then the mappings, then ``dtype``
    and the model path. Raises ``ConfigError``.
    """
    return cast(EngineConfig, build_document(ENGINE_ROOT, model, dtype=dtype,
                                             overrides=overrides, groups=groups,
                                             quantization=quantization))


def build_document(root: ConfigRoot, model: str | None = None, *, dtype: str | None = None,
                   overrides: Sequence[str] = (),
                   groups: Mapping[str, str | Mapping] | None = None,
                   quantization: str | None = None) -> BaseModel:
    """``build_config`` for any root, validated as ``root.schema``."""
    return validate_document(_build_dict(root, model, dtype, overrides, groups, quantization),
                             root.schema)


def _build_dict(root: ConfigRoot, model: str | None, dtype: str | None,
                overrides: Sequence[str], groups: Mapping[str, str | Mapping] | None,
                quantization: str | None = None) -> dict:
    if isinstance(overrides, str):
        overrides = [overrides]
    hydra_overrides: list[str] = []
    merges: dict = {}
    group_names = set(_groups(root))
    for key, value in (groups or {}).items():
        if isinstance(value, str) and (key in group_names
                                       or model_at(key, root.schema) is not None):
            if key not in group_names:
                raise ConfigError(key, value, f"a mapping of {key}'s fields ({key} is not a "
                                  f"config group; groups: {', '.join(sorted(group_names))})")
            options = group_options(key, root)
            if key == RECIPE_GROUP and is_recipe_path(value):
                _recipe_file(value)
            elif value not in options:
                raise ConfigError(key, value, _options_text(key, options))
            hydra_overrides.append(f"{key}={value}")
        elif value is None and key == RECIPE_GROUP:
            continue
        elif isinstance(value, Mapping) and "name" in value and key in group_names:
            # {"name": impl, ...}: select that implementation's file, then merge the rest.
            name = value["name"]
            options = group_options(key, root)
            if name in options:
                hydra_overrides.append(f"{key}={name}")
            merges[key] = _plain(value)
        elif isinstance(value, Mapping):
            merges[key] = _plain(value)
        else:
            merges[key] = _plain(value)
    model_merges: dict = {}
    if model is not None:
        if not isinstance(model, (str, Path)):
            raise ConfigError("model", model, "a preset name or a path")
        model_overrides, model_merges = resolve_model_arg(str(model))
        hydra_overrides = model_overrides + hydra_overrides
    data = _compose_dict(hydra_overrides + list(overrides), root)
    _deep_merge(data, merges)
    if dtype is not None:
        _deep_merge(data, {"model": {"dtype": dtype}})
    if quantization is not None:
        _deep_merge(data, {"model": {"quantization": quantization}})
    _deep_merge(data, model_merges)
    return data


# --------------------------------------------------------------------------- printing

def config_to_yaml(cfg: BaseModel | Mapping[str, Any]) -> str:
    """The config (a model, or its ``model_dump(by_alias=True, mode="json")``) as YAML, by
    alias (``_target_``), without ``_target_: null`` entries."""
    from omegaconf import OmegaConf

    data = (cfg.model_dump(by_alias=True, mode="json") if isinstance(cfg, BaseModel)
            else dict(cfg))

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()
                    if not (k == "_target_" and v is None)}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return OmegaConf.to_yaml(OmegaConf.create(strip(data)))
