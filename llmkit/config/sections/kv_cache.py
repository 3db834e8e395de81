"""Where the KV cache lives: the pool (``kv_cache``), the connector that hands a request's KV
between engines (``kv_transfer``) and the tiers below the pool (``kv_offload``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmkit.config.sections.strict import _Component, _Strict

__all__ = ["KVCacheConfig", "KVOffloadConfig", "KVTransferConfig"]


class KVCacheConfig(_Component):
    name: str = "paged"
    block_size: int = Field(default=16, ge=1)
    num_blocks: int | None = Field(default=None, ge=1)
    memory_gib: float = Field(default=4.0, gt=0)
    enable_prefix_caching: bool = True
    eviction_policy: Literal["lru", "lfu"] = "lru"
    pinned_prefixes: list[str | list[int]] = Field(default_factory=list)
    # What the pool stores (vLLM's kv_cache_dtype): auto = the model's dtype; bfloat16 /
    # float16 store K/V in that type; int8 / fp8_e4m3 (fp8 = fp8_e4m3, vLLM's alias) store
    # one-byte codes with a float32 scale per (token, KV head) row (llmkit.kernels.kv_quant):
    # about twice the blocks of bf16 in the same memory.
    cache_dtype: Literal["auto", "bfloat16", "float16", "fp8_e4m3", "fp8", "int8"] = "auto"

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ..., 16, 32, ...), got {v}")
        return v


class KVTransferConfig(_Component):
    """Group ``kv_transfer``: a KV connector hands a request's KV between engines
    (``llmkit/kv_transfer``). ``none`` = off."""

    name: str = "none"
    # vLLM's roles: a producer prefills and holds the KV until a consumer has loaded it; a
    # consumer loads KV that a producer computed; kv_both does either, per request.
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    # This engine's name among its peers (null = one made from the process id and time).
    engine_id: str | None = None
    # shared_memory: the folder (on a memory file system) where producers expose their KV pool.
    shm_dir: str = "/dev/shm/llmkit-kv"
    # A producer frees a finished request's blocks after this long if no consumer took them.
    transfer_timeout_s: float = Field(default=60.0, gt=0)
    # zmq: where a producer serves its blocks (a producer needs a port; the address travels
    # to consumers in kv_transfer_params) and how long a consumer waits for a reply.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(default=0, ge=0, le=65535)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _role_needs_a_connector(self) -> "KVTransferConfig":
        # A producer or consumer without a connector cannot hand KV anywhere: it used to start
        # and then refuse every request with kv_transfer_params (issue 31.12). kv_both is the
        # neutral default, meaningful alone.
        if self.name == "none" and self.target is None and self.kv_role != "kv_both":
            raise ValueError(
                "kv_transfer.kv_role=kv_both while kv_transfer=none (no KV connector); "
                "kv_producer and kv_consumer need a connector: kv_transfer=shared_memory, "
                "kv_transfer=zmq or a kv_transfer._target_")
        return self


class KVOffloadConfig(_Strict):
    """Group ``kv_offload``: tiers below the KV pool (``llmkit/kv_transfer/offload.py``).

    Blocks evicted from the pool are kept in host memory (``host_gib``) and/or files in
    ``disk_path`` (``disk_gib``), keyed by their block hashes, and loaded on a prefix miss
    instead of being recomputed. Off while ``host_gib`` is 0 and ``disk_path`` is null."""

    host_gib: float = Field(default=0.0, ge=0)
    # lossless encoding of host-tier blocks (byte shuffle, then zlib or zstd: more blocks in
    # host_gib for CPU time on each store and load); zstd needs the zstandard package
    host_compression: Literal["none", "zlib", "zstd"] = "none"
    disk_path: str | None = None
    disk_gib: float = Field(default=4.0, gt=0)

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or self.disk_path is not None
