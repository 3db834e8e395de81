"""What an executor reports about the model it serves and how it computes: plain data (no torch),
so that the API process, which never builds a model, can hold the engine's facts too."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackendInfo", "ModelFacts"]


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What the core (and the front ends' input checks) need to know about the model served."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    # Every end-of-sequence id of the model: the first is ``eos_token_id``; the others (e.g. a
    # chat model's end-of-turn) act as stop tokens (vLLM's rule).
    eos_token_ids: tuple[int, ...] = ()
    # A model whose layers keep other state than full attention: its KV-cache groups
    # (``llmkit.kv_cache.groups.KVCacheGroup``, by its ``kv_cache_specs()``) and the block size
    # its pool's layout needs (``kv_cache.block_size`` or raised). Empty / None: full
    # attention in every layer.
    kv_cache_groups: tuple = ()
    kv_block_size: int | None = None


@dataclass(slots=True, frozen=True)
class BackendInfo:
    """How an executor computes, in words: for logs, benchmark results and tools (nothing
    decides by it)."""

    attention: str  # the attention backend's name (cpu, torch, triton, ...)
    ops: str  # the platform ops' name (norm, rotary, activation, KV write)
    # The distinct ``LinearMethod.describe()`` texts of the model's linear layers.
    linear_methods: tuple[str, ...]
    dtype: str  # the compute dtype (float32, bfloat16, ...)
    device: str
    # Step graphs (compilation.mode=graphs): their name and the most rows a graph covers;
    # None when decode steps run eagerly.
    step_graphs: str | None = None
    step_graphs_max_rows: int = 0
    # True while they still compile in the background (decode steps run eagerly until then;
    # as of when this was asked: a worker process reports it once, when it is ready).
    step_graphs_pending: bool = False
    # The instruction-set tier of the CPU kernels (platform.isa resolved: avx2 ... avx512_bf16);
    # None off the CPU or without the kernels.
    isa: str | None = None
