"""How a pooling engine (``model.runner=pooling``) turns a prompt's hidden states into one
embedding: which token(s) it pools and whether it normalizes, from the model folder's
sentence-transformers files (``modules.json``, ``1_Pooling/config.json``, a ``Normalize``
module) or, failing those, the architecture's default (vLLM's: last token for decoders, CLS
for BERT-style encoders, normalized). Plain data: the front end (``dimensions``) and the worker
(the pooling itself) both resolve it from the same config and files.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from llmkit.config.errors import ConfigError

if TYPE_CHECKING:
    from llmkit.config.schema import ModelConfig
    from llmkit.models.loader import ModelSource

__all__ = ["PoolingSpec", "resolve_pooling", "resolve_runner"]

logger = logging.getLogger(__name__)

PoolingType = Literal["LAST", "MEAN", "CLS"]

#: Architectures whose checkpoints are encoders: bidirectional attention, CLS pooling.
ENCODER_ARCHITECTURES = frozenset({"BertModel"})
#: sentence-transformers ``Pooling`` modes llmkit computes, by their config keys.
_ST_MODES: dict[str, PoolingType] = {"pooling_mode_lasttoken": "LAST",
                                     "pooling_mode_mean_tokens": "MEAN",
                                     "pooling_mode_cls_token": "CLS"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """``pooling_type``: which hidden states make the embedding (the last prompt token's, the
    mean of every prompt token's, or the first token's); ``normalize``: L2-normalized after;
    ``dimensions``: the embedding's width; ``matryoshka_dimensions``: the widths a request may
    truncate it to (``()``: any width below ``dimensions`` when ``is_matryoshka``, none
    otherwise); ``source``: where the choice came from, for logs and errors."""

    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    source: str = "architecture default"
    #: an encoder (bidirectional attention): each prompt is computed in one step
    bidirectional: bool = False

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's hidden state is needed (mean), or the first one's
        (CLS): a prefix-cache hit computes neither, so such an engine runs without one."""
        return self.pooling_type != "LAST"

    def allows_dimensions(self, n: int) -> bool:
        if not self.is_matryoshka or n < 1 or n > self.dimensions:
            return False
        return not self.matryoshka_dimensions or n in self.matryoshka_dimensions



def resolve_runner(model_config: "ModelConfig", source: "ModelSource") -> str:
    """``generate`` or ``pooling``: ``model.runner``, or for ``auto`` pooling when the
    architecture is an embedding one (a bare ``*Model`` such as ``Qwen3Model`` or
    ``BertModel``) and generate for ``*ForCausalLM`` and the rest."""
    runner = model_config.runner
    arch = source.architecture
    if arch in ENCODER_ARCHITECTURES and runner == "generate":
        raise ConfigError("model.runner", runner,
                          f"pooling or auto ({arch} is an encoder: it computes embeddings only)")
    if runner != "auto":
        return runner
    return "pooling" if arch.endswith("Model") else "generate"


def resolve_pooling(model_config: "ModelConfig", source: "ModelSource") -> PoolingSpec | None:
    """The pooling of an engine that embeds, or None for one that generates."""
    if resolve_runner(model_config, source) != "pooling":
        return None
    hf = source.hf_config
    text = getattr(hf, "text_config", None) or hf
    dims = int(text.hidden_size)
    matryoshka = tuple(int(d) for d in (getattr(hf, "matryoshka_dimensions", None) or ()))
    is_matryoshka = bool(getattr(hf, "is_matryoshka", False)) or bool(matryoshka)
    folder = source.path if source.path.is_dir() else None
    st = _sentence_transformers(folder) if folder is not None else None
    if st is not None:
        pooling_type, normalize = st
        where = f"{folder}/modules.json"
    else:
        pooling_type = "CLS" if source.architecture in ENCODER_ARCHITECTURES else "LAST"
        normalize, where = True, "architecture default"
    spec = PoolingSpec(pooling_type, normalize, dims, is_matryoshka, matryoshka, where,
                       source.architecture in ENCODER_ARCHITECTURES)
    logger.info("pooling: %s tokens%s, %d dimensions (%s)", pooling_type.lower(),
                ", normalized" if normalize else "", dims, where)
    return spec


def _sentence_transformers(folder: Path) -> tuple[PoolingType, bool] | None:
    """``(pooling type, normalize)`` from a sentence-transformers folder; None without one.
    A module llmkit does not compute (a ``Dense`` projection, weighted-mean pooling) fails at
    start-up rather than giving embeddings that differ from the model's."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type: PoolingType | None = None
    normalize = False
    for m in modules:
        kind = m.get("type", "")
        if kind == _ST_POOLING:
            pooling_type = _st_pooling_mode(folder / m.get("path", ""), modules_file)
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind != _ST_TRANSFORMER:
            raise ConfigError("model.path", str(folder),
                              f"a sentence-transformers folder whose modules are Transformer, "
                              f"Pooling and Normalize ({modules_file} lists {kind})")
    if pooling_type is None:
        return None
    return pooling_type, normalize


def _st_pooling_mode(pooling_dir: Path, modules_file: Path) -> PoolingType:
    cfg_file = pooling_dir / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ConfigError("model.path", str(modules_file.parent),
                          f"a Pooling module with one of {', '.join(sorted(_ST_MODES))} set "
                          f"({cfg_file} sets {', '.join(on) or 'none'})")
    return _ST_MODES[on[0]]
