"""The KV cache's memory for a model of full-attention layers only (one block table): one
tensor per layer in the attention backend's shape, a draft model's layers beside them in the
same blocks. Models with other layer kinds are planned in ``kv_cache_setup``.

A quantized cache's rows hold ``head_dim`` codes and their float32 scale
(``llmkit.kernels.kv_quant``), so a row's width is ``cache_row_width``, not ``head_dim``.
"""
from __future__ import annotations

import logging
import mmap

import numpy as np
import torch

from llmkit.attention.base import AttentionBackend
from llmkit.config.errors import ConfigError
from llmkit.kernels.kv_quant import cache_row_width
from llmkit.kernels.kv_quant import format_of as kv_quant_format_of
from llmkit.kv_transfer.base import KVConnectorBase, KVLayout

__all__ = ["allocate", "bytes_per_block", "check_row_alignment", "kv_layout", "layer_shape",
           "model_layers", "zeros"]

logger = logging.getLogger(__name__)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, an anonymous mapping's zero pages are mapped lazily: a 4 GiB
    KV pool costs nothing until used, where torch.zeros would write every byte at start-up
    (seconds).

    Its pages are small ones (``MADV_NOHUGEPAGE``): numpy's ``zeros`` asks for transparent huge
    pages, and then the first K/V row a step writes into each 2 MiB costs a fault that zeroes
    (and may first compact) 2 MiB: on a VM, milliseconds inside the step, several times a
    prefill step's whole K/V copy (``docs/cpu-speed.md``). Small pages fault only what a step
    writes, and decode attention, which reads the blocks back, measured no slower on them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    nbytes = int(np.prod(shape)) * itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds the mapping (frombuffer keeps its buffer alive)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def check_row_alignment(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A quantized row's float32 scale must sit 4-byte aligned after its head_dim codes."""
    fmt = kv_quant_format_of(dtype)
    if fmt is not None and model.head_dim % 4:
        raise ConfigError("kv_cache.cache_dtype", fmt.name,
                          f"auto, bfloat16 or float16 for this model (head_dim "
                          f"{model.head_dim} is not a multiple of 4)")


def layer_shape(backend: AttentionBackend, num_blocks: int, block_size: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
    """One layer's pool shape."""
    return backend.kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                  cache_row_width(head_dim, dtype))


def model_layers(model: torch.nn.Module,
                 draft_layers: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(kv_heads, head_dim)`` of every layer the pool holds: the model's, then a draft
    model's (or EAGLE head's), whose KV lives in the same blocks."""
    return [(model.num_kv_heads, model.head_dim)] * model.num_layers + draft_layers


def bytes_per_block(backend: AttentionBackend, block_size: int, dtype: torch.dtype,
                    layers: list[tuple[int, int]]) -> int:
    """Bytes of one block over ``layers`` (``model_layers``) in ``dtype``."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return sum(int(np.prod(layer_shape(backend, 1, block_size, h, d, dtype))) * itemsize
               for h, d in layers)


def kv_layout(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
              dtype: torch.dtype, fingerprint: str) -> KVLayout:
    """The pool's layout, for KV connectors: the block axis found by comparing the shapes
    of one and two blocks. A quantized block's scales are inside its rows, so they travel
    wherever its bytes do."""
    h, d = model.num_kv_heads, model.head_dim
    one = layer_shape(backend, 1, block_size, h, d, dtype)
    two = layer_shape(backend, 2, block_size, h, d, dtype)
    dim = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
    return KVLayout(num_layers=model.num_layers, block_shape=one[:dim] + one[dim + 1:],
                    block_dim=dim, dtype=str(dtype).removeprefix("torch."),
                    block_size=block_size, fingerprint=fingerprint)


def allocate(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
             dtype: torch.dtype, num_blocks: int, device: torch.device,
             conn: KVConnectorBase | None,
             draft_layers: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The model's per-layer caches; a KV connector may own their memory (a shared-memory
    producer) and is handed them either way."""
    shape = layer_shape(backend, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                        dtype)
    _log_pool(model, backend, block_size, dtype, num_blocks, draft_layers)
    owned = conn.allocate_kv_caches(shape, dtype, model.num_layers,
                                    device) if conn is not None else None
    caches = owned if owned is not None else [zeros(shape, dtype, device)
                                              for _ in range(model.num_layers)]
    if conn is not None:
        conn.register_kv_caches(caches)
    return caches


def _log_pool(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
              dtype: torch.dtype, num_blocks: int, draft_layers: list[tuple[int, int]]) -> None:
    """Start-up says what a quantized (or narrower) cache buys: blocks in the same memory."""
    model_dtype = getattr(model, "dtype", None)
    if not isinstance(model_dtype, torch.dtype) or model_dtype == dtype:
        return
    fmt = kv_quant_format_of(dtype)
    name = fmt.name if fmt is not None else str(dtype).removeprefix("torch.")
    layers = model_layers(model, draft_layers)
    mine = bytes_per_block(backend, block_size, dtype, layers)
    theirs = bytes_per_block(backend, block_size, model_dtype, layers)
    logger.info("KV cache %s%s: %d bytes a block vs %d at %s, %.2fx the blocks in the same "
                "memory (%d blocks)", name,
                " (codes + a float32 scale per token and KV head)" if fmt else "", mine,
                theirs, str(model_dtype).removeprefix("torch."), theirs / mine, num_blocks)
