"""Which model ``llmkit sim`` simulates, found without reading any weights.

- ``sim.model=NAME``: a shape shipped in ``llmkit/cost_model/shapes/NAME.json``
  (e.g. ``llama-2-7b``), so people can simulate models they do not have; or a ``config.json``; or an HF folder / a
  ``.gguf`` (read through ``llmkit.models.loader.resolve_model_source``, which reads the config
  only). The ``model`` section is then not used; ``sim.max_model_len`` caps the context.
- ``sim.model`` unset: ``MODEL`` / ``model.path`` / the model preset, exactly as a real engine
  would resolve it (``model.max_model_len`` applies).

The dtype: ``sim.dtype`` if set, else ``model.dtype`` if not ``auto``, else the checkpoint's
``torch_dtype``, else the hardware profile's ``default_dtype``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from llmkit.cost_model.model_shape import ModelShape, ShapeError, load_shape, shape_names
from llmkit.models.max_model_len import cap_max_model_len

__all__ = ["SimModel", "VocabTokenizer", "resolve_sim_dtype", "resolve_sim_model",
           "workload_tokenizer"]

logger = logging.getLogger(__name__)


@dataclass
class SimModel:
    name: str
    shape: ModelShape
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    # The resolved real model (an HF folder or .gguf) when there is one: its tokenizer.
    source: Any = None


def _max_model_len(shape: ModelShape, requested: int | None, name: str) -> int:
    return cap_max_model_len(shape.max_position_embeddings, requested, key="sim.max_model_len",
                             model=name, error=ShapeError)


def _from_source(source: Any, name: str) -> SimModel:
    shape = ModelShape.from_hf_config(source.hf_config, name=name)
    return SimModel(name=name, shape=shape, max_model_len=source.max_model_len,
                    eos_token_ids=list(source.eos_token_ids), source=source)


def resolve_sim_model(cfg: Any) -> SimModel:
    """The model ``cfg`` (a ``SimToolConfig``) simulates."""
    from llmkit.config.errors import ConfigError
    from llmkit.config.schema import ModelConfig
    from llmkit.models.loader import resolve_model_source

    spec = cfg.sim.model
    if spec is None:
        try:
            source = resolve_model_source(cfg.engine.model)
        except (ValueError, OSError, RuntimeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ShapeError(f"{e} (or simulate a named shape: sim.model="
                             f"{'|'.join(shape_names())})") from None
        model = cfg.engine.model
        name = model.served_name or model.name or source.path.stem
        if name == "custom":
            name = source.path.stem if source.is_gguf else source.path.name
        return _from_source(source, name)
    if spec in shape_names():
        shape = load_shape(spec)
        return SimModel(name=spec, shape=shape,
                        max_model_len=_max_model_len(shape, cfg.sim.max_model_len, spec),
                        eos_token_ids=list(shape.eos_token_ids))
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or (path.is_dir() and (path / "config.json").is_file()):
        try:
            source = resolve_model_source(ModelConfig(path=str(path),
                                                      max_model_len=cfg.sim.max_model_len))
        except (ValueError, OSError, KeyError) as e:
            if path.is_dir():
                # transformers may not know the architecture: the raw JSON still has the shape
                logger.info("sim.model=%s: reading config.json directly (%s)", spec, e)
            else:
                raise ShapeError(f"sim.model {spec!r}: {e}") from None
        else:
            return _from_source(source, path.stem if source.is_gguf else path.name)
    shape = load_shape(spec)  # config.json / folder, or a clear error naming the shapes
    return SimModel(name=shape.name, shape=shape,
                    max_model_len=_max_model_len(shape, cfg.sim.max_model_len, shape.name),
                    eos_token_ids=list(shape.eos_token_ids))


def resolve_sim_dtype(cfg: Any, shape: ModelShape, hardware: Any) -> str:
    if cfg.sim.dtype != "auto":
        return cfg.sim.dtype
    if cfg.sim.model is None and cfg.engine.model.dtype != "auto":
        return cfg.engine.model.dtype
    if shape.checkpoint_dtype in ("float32", "bfloat16", "float16"):
        return shape.checkpoint_dtype
    return hardware.default_dtype


class VocabTokenizer:
    """A stand-in tokenizer for models given by shape only: the vocabulary's size and special
    ids, which is all the random and shared-prefix datasets draw prompts from. It cannot encode
    or decode text."""

    def __init__(self, vocab_size: int, special_ids: Sequence[int] = ()) -> None:
        self.vocab_size = int(vocab_size)
        self.all_special_ids = sorted({int(i) for i in special_ids if 0 <= int(i) < vocab_size})

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        from llmkit.tools.bench.datasets import WorkloadError
        raise WorkloadError("this workload has text prompts but the simulated model has no "
                            "tokenizer (a named shape): set bench.tokenizer=PATH or use token-id "
                            "prompts")

    def decode(self, ids: Sequence[int]) -> str:
        return self.encode("")  # type: ignore[return-value]


def workload_tokenizer(cfg: Any, model: SimModel) -> Any:
    """The tokenizer the workload is built with: ``bench.tokenizer``, else the model's own when
    it has one, else a ``VocabTokenizer`` over the shape's vocabulary (prompt lengths and
    prefix sharing — all that a step's cost depends on — are the same)."""
    if cfg.bench.tokenizer:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(cfg.bench.tokenizer)
    if model.source is not None:
        try:
            return model.source.load_tokenizer()
        except Exception as e:  # noqa: BLE001 - any loader failure: fall back to the vocabulary
            logger.info("no tokenizer for %s (%s: %s): drawing prompt ids from its vocabulary",
                        model.name, type(e).__name__, e)
    return VocabTokenizer(model.shape.vocab_size, model.eos_token_ids)
