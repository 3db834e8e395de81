"""KV connectors: KV that enters and leaves an engine's pool (``base.KVConnectorBase``).

``kv_transfer.name`` picks a connector for disaggregated serving (``shared_memory``);
``kv_offload.*`` turns on the offload tiers (``offload``). Registered third-party connectors
come in by the ``llmkit.kv_transfer`` entry point or ``kv_transfer._target_``.
"""
from __future__ import annotations

import functools
from typing import Callable

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVConnectorStats, KVLayout)
from llmkit.registry import Registry

KV_CONNECTORS: Registry[KVConnectorBase] = Registry("kv_transfer")
KV_CONNECTORS.register_lazy("offload", "llmkit.kv_transfer.offload.OffloadingConnector")
KV_CONNECTORS.register_lazy("shared_memory",
                            "llmkit.kv_transfer.shared_memory.SharedMemoryConnector")
KV_CONNECTORS.register_lazy("zmq", "llmkit.kv_transfer.zmq.ZmqConnector")


def kv_connector_class(config: EngineConfig) -> Callable[..., KVConnectorBase] | None:
    """What builds the connector the config asks for (``f(config, role, layout)``), or None;
    ConfigError naming the key when the combination cannot work. A transfer connector with
    offload tiers is a ``MultiConnector`` of both."""
    kt, ko = config.kv_transfer, config.kv_offload
    transfer = kt.target is not None or kt.name != "none"
    if ko.enabled and not config.kv_cache.enable_prefix_caching:
        raise ConfigError("kv_offload.host_gib" if ko.host_gib else "kv_offload.disk_path",
                          ko.host_gib or ko.disk_path, "", message=(
                              "the offload tiers are keyed by block hashes, so they need "
                              "kv_cache.enable_prefix_caching=true; it is false"))
    if ko.host_compression != "none":
        if not ko.host_gib:
            raise ConfigError("kv_offload.host_compression", ko.host_compression, "none",
                              message="host_compression encodes the host tier's blocks; "
                              "kv_offload.host_gib is 0 (no host tier)")
        if ko.host_compression == "zstd":
            try:
                import zstandard  # noqa: F401
            except ImportError:
                raise ConfigError("kv_offload.host_compression", "zstd", "none, zlib",
                                  message="zstd needs the zstandard package (pip install "
                                  "zstandard), or use host_compression=zlib") from None
    executor = config.executor.name
    if executor == "auto" and config.parallel.world_size == 1:
        executor = "uniproc"
    if (executor != "uniproc" or config.executor.target) and (transfer or ko.enabled):
        raise ConfigError("executor.name", config.executor.name, "uniproc", message=(
            f"executor {config.executor.name!r} has no KV connector seam; kv_transfer and "
            "kv_offload need executor=uniproc"))
    offload = KV_CONNECTORS.get("offload") if ko.enabled else None
    if not transfer:
        return offload
    if kt.target is None and kt.name not in KV_CONNECTORS:
        raise ConfigError("kv_transfer.name", kt.name,
                          ", ".join(["none", *sorted(n for n in KV_CONNECTORS.names()
                                                     if n != "offload")]))
    try:
        cls = KV_CONNECTORS.resolve(None if kt.target else kt.name, kt.target)
    except ImportError as e:
        raise ConfigError("kv_transfer._target_", kt.target,
                          f"an importable class path ({e})") from None
    if offload is None:
        return cls
    from llmkit.kv_transfer.multi import MultiConnector

    # The transfer first: a consumer's remote KV covers the whole prompt.
    return functools.partial(MultiConnector, classes=[cls, offload])


__all__ = ["KV_CONNECTORS", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVConnectorStats", "KVLayout", "kv_connector_class"]
