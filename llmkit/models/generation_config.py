"""A model's recommended sampling defaults, as vLLM applies them (``--generation-config``).

Model authors ship the temperature, top-p, ... their model is meant to be sampled with in its
``generation_config.json``. vLLM reads ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``) from it, and a request that
leaves one of them unset gets the model's value instead of ``SamplingParams``' own default:

- on the server, a field the request body leaves out (``max_tokens``: the model's value caps
  the request's, as in vLLM);
- in ``LLM``, ``generate`` / ``chat`` / ``stream`` with ``sampling_params=None``
  (``LLM.get_default_sampling_params()``); an explicit ``SamplingParams`` is taken as given,
  as in vLLM.

``model.generation_config`` says where the defaults come from: ``auto`` (the model's: its
folder's ``generation_config.json``, then ``model.generation_defaults``, which a preset sets
when its files carry none, e.g. a GGUF), ``vllm`` (none: ``SamplingParams``' defaults) or a
path (that folder's ``generation_config.json``, or that JSON file).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.config.errors import ConfigError

if TYPE_CHECKING:
    from llmkit.config.schema import ModelConfig

__all__ = ["FILE_NAME", "default_sampling_fields", "describe_defaults"]

FILE_NAME = "generation_config.json"
# generation_config.json's names -> SamplingParams' (vLLM's list).
_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
           "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
_ALLOWED = ("auto, vllm, or a folder holding generation_config.json, or such a JSON file")


def _read_file(path: Path, key_value: str | None = None) -> dict[str, Any]:
    """The sampling fields that ``path`` (a generation_config.json) sets."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("model.generation_config", key_value or str(path), _ALLOWED,
                          message=f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("model.generation_config", key_value or str(path), _ALLOWED,
                          message=f"{path} does not hold a JSON object")
    return {ours: data[theirs] for theirs, ours in _FIELDS.items()
            if data.get(theirs) is not None}


def _from_path(value: str) -> dict[str, Any]:
    path = Path(value).expanduser()
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        raise ConfigError("model.generation_config", value, _ALLOWED)
    return _read_file(file, value)


def default_sampling_fields(model_config: "ModelConfig",
                            model_path: Path | None) -> dict[str, Any]:
    """``{SamplingParams field: value}`` that requests leaving the field unset get.

    ``model_path``: the resolved model (an HF folder or a .gguf file). Raises ``ConfigError``
    naming ``model.generation_config`` for a path without a generation config, and for values
    ``SamplingParams`` refuses."""
    mode = model_config.generation_config
    if mode == "vllm":
        return {}
    if mode == "auto":
        fields: dict[str, Any] = {}
        if model_path is not None and model_path.is_dir() and (model_path / FILE_NAME).is_file():
            fields.update(_read_file(model_path / FILE_NAME))
        stated = model_config.generation_defaults.model_dump(exclude_none=True)
        fields.update(stated)
    else:
        fields = _from_path(mode)
    from llmkit.sampling.params import SamplingParams

    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError("model.generation_config", mode, _ALLOWED,
                          message=f"the model's sampling defaults are not usable: {e}") from None
    return fields


def describe_defaults(model_config: "ModelConfig", fields: dict[str, Any]) -> str:
    """One line for the start-up log: which defaults requests that leave a field unset get."""
    mode = model_config.generation_config
    if not fields:
        where = ("model.generation_config=vllm" if mode == "vllm"
                 else f"the model states none (model.generation_config={mode})")
        return f"sampling defaults: SamplingParams' own (temperature=1.0, top_p=1.0; {where})"
    shown = ", ".join(f"{k}={v}" for k, v in fields.items())
    return (f"sampling defaults from the model (model.generation_config={mode}; "
            f"model.generation_config=vllm turns them off): {shown}")
