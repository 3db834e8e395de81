"""A model in one ``.gguf`` file (llama.cpp's format): its weights, and (re-exported from
``llmkit.models.gguf_metadata``) its config and tokenizer.

Weights are located with transformers' fast GGUF header reader (``gguf.GGUFReader`` when that
cannot read the file), dequantized with ``gguf.quants.dequantize`` (every quantization type
gguf-py knows), renamed to Hugging Face names, and for llama-architecture
files the q/k rows are un-permuted with transformers' ``TensorProcessor`` for that
architecture (llama.cpp reorders them for its rope layout).
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

# the config and tokenizer, where callers have always found them
from llmkit.models.gguf_metadata import (gguf_cache_folder, load_gguf_config,  # noqa: F401
                                         load_gguf_tokenizer)

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

    from llmkit.linear.quantized import GGUFRows

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face module name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Rope factor tensors of some converters; llmkit computes rope from the config (see below).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_0-9]+)\.(weight|bias)$")


def is_gguf_file(path: Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None if it has none."""
    if m := _LAYER_RE.match(name):
        module = _LAYER_NAMES.get(m.group(2))
        return None if module is None else f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
    if m := _GLOBAL_RE.match(name):
        module = _GLOBAL_NAMES.get(m.group(1))
        return None if module is None else f"{module}.{m.group(2)}"
    return None


# -- weights ---------------------------------------------------------------------------------
def iter_gguf_weights(path: Path, hf_config, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, "torch.Tensor | GGUFRows"]]:
    """``(hf_name, tensor)`` for every tensor of the file, dequantized to float32 one at a
    time; with ``keep_quantized`` (``model.quantization=gguf``) the matrices in a type the
    kernels keep (``GGUF_KEPT``) come as their raw rows (:class:`GGUFRows`) instead, q/k rows
    un-permuted the same way, and every other quantized type is dequantized with one notice
    per type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS,
                                                          LlamaTensorProcessor, TensorProcessor)

    from llmkit.kernels.quant.formats import GGUF_KEPT
    from llmkit.linear.quantized import GGUFRows

    path = Path(path)
    arch, tensors = _read_tensors(path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
    })
    # Row permutations (llama's q/k) apply to raw block rows as to float rows; processors
    # that compute on values (other architectures) would not.
    rows_only = type(processor) in (TensorProcessor, LlamaTensorProcessor)
    floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    noticed: set[str] = set()
    for name, qtype, data in tensors:
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            if name in _SKIPPED:
                # llama.cpp's per-frequency rope factors (Llama 3.1+ files): transformers' GGUF
                # config does not carry that scaling either, so long-wavelength frequencies
                # follow the plain rope_theta here.
                logger.warning("%s: ignoring %s (llama.cpp rope frequency factors); rope comes "
                               "from the config (%s)", path.name, name,
                               getattr(hf_config, "rope_parameters", None))
                continue
            raise ValueError(f"{path.name}: tensor {name!r} has no Hugging Face counterpart "
                             "that llmkit knows")
        if keep_quantized and qtype not in floats:
            kept = GGUF_KEPT.get(qtype.name)
            if kept is not None and rows_only and data.ndim == 2:
                raw = processor.process(weights=data, name=name).weights
                raw = np.array(raw, copy=True, order="C")
                block_size, type_size = GGML_QUANT_SIZES[qtype]
                cols = raw.shape[1] // type_size * block_size
                yield hf_name, GGUFRows(torch.from_numpy(raw), kept, cols)
                continue
            if qtype.name not in noticed:
                noticed.add(qtype.name)
                logger.warning("%s: %s tensors are dequantized to float at load (llmkit keeps "
                               "%s quantized)", path.name, qtype.name, ", ".join(GGUF_KEPT))
        weights = dequantize(data, qtype)
        weights = processor.process(weights=weights, name=name).weights
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights, copy=True, order="C")
        yield hf_name, torch.from_numpy(weights)


def _read_tensors(
        path: Path) -> tuple[str, Iterator[tuple[str, "GGMLQuantizationType", np.ndarray]]]:
    """``(architecture, [(name, type, data)])`` with ``data`` laid out as ``gguf.GGUFReader``
    gives it (rows of packed blocks, or typed values for F32/F16).

    transformers' header reader skips the vocabulary (milliseconds, where ``GGUFReader`` parses
    every token string: seconds); files it cannot read go to ``GGUFReader``.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        from transformers.integrations.gguf.reader import GgufHeader
        header = GgufHeader.from_file(str(path))
    except (ImportError, ValueError, KeyError) as e:
        logger.debug("fast GGUF header read failed (%s); using gguf.GGUFReader", e)
        from gguf import GGUFReader
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
        return arch, ((t.name, t.tensor_type, t.data) for t in reader.tensors)

    blob = np.memmap(str(path), mode="r", dtype=np.uint8)
    typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}

    def tensors():
        for info in header.tensors:
            qtype = GGMLQuantizationType(info.ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            *rows, cols = info.shape or (1,)
            nbytes = math.prod(rows) * (cols // block_size) * type_size
            start = header.data_start + info.offset
            raw = blob[start:start + nbytes]
            if qtype in typed:
                yield info.name, qtype, raw.view(typed[qtype]).reshape(info.shape)
            else:
                yield info.name, qtype, raw.reshape(*rows, cols // block_size * type_size)

    return header.architecture, tensors()
