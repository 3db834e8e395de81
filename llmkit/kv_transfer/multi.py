"""Several KV connectors at once (vLLM's ``MultiConnector``): a transfer connector and the
offload tiers. The first connector that can load some of a request's tokens loads them; the
others are told it got none. Every connector sees evictions, finishes and the worker's steps;
a request's blocks stay held while any of them asks."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                     KVConnectorRole, KVConnectorStats, KVLayout)

if TYPE_CHECKING:
    import torch

    from llmkit.request import Request


class MultiMetadata(KVConnectorMetadata):
    def __init__(self, parts: list[KVConnectorMetadata | None]) -> None:
        self.parts = parts


class MultiConnector(KVConnectorBase):
    name = "multi"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout,
                 classes: list[type[KVConnectorBase]]) -> None:
        super().__init__(config, role, layout)
        self.connectors = [cls(config, role, layout) for cls in classes]
        self._chosen: dict[str, int] = {}

    @property
    def stats(self) -> KVConnectorStats:
        """The parts' lookups and hits, and the worker's transfer counters (reported for all
        parts at once)."""
        total = self._own.snapshot()
        for c in self.connectors:
            total.queries += c.stats.queries
            for tier, n in c.stats.hits_per_tier.items():
                total.hit(tier, n)
        return total

    @stats.setter
    def stats(self, value: KVConnectorStats) -> None:
        self._own = value

    # -- scheduler side ------------------------------------------------------------------
    def bind_block_hasher(self, fn) -> None:
        for c in self.connectors:
            c.bind_block_hasher(fn)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        for i, c in enumerate(self.connectors):
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._chosen[request.request_id] = i
                return n, load_async
        self._chosen.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, -1)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids,
                                       num_external_tokens if i == chosen else 0)

    def build_connector_meta(self) -> MultiMetadata | None:
        parts = [c.build_connector_meta() for c in self.connectors]
        return MultiMetadata(parts) if any(p is not None for p in parts) else None

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = False, None
        for c in self.connectors:
            d, p = c.request_finished(request, block_ids)
            delay = delay or d
            params = params if p is None else p
        return delay, params

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Counters once, here; each part also sees the output (its finished loads and stored
        sizes), with its own counters left alone."""
        self._own.add_output(output)
        for c in self.connectors:
            c.on_connector_output(output)

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        for c in self.connectors:
            c.on_blocks_evicted(evicted)

    def shutdown_meta(self, cached: list[tuple[int, bytes]]) -> MultiMetadata | None:
        parts = [c.shutdown_meta(cached) for c in self.connectors]
        return MultiMetadata(parts) if any(p is not None for p in parts) else None

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()

    # -- worker side ---------------------------------------------------------------------
    def allocate_kv_caches(self, shape, dtype, num_layers, device=None):
        for c in self.connectors:
            caches = c.allocate_kv_caches(shape, dtype, num_layers, device)
            if caches is not None:
                return caches
        return None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        parts = metadata.parts if isinstance(metadata, MultiMetadata) else \
            [None] * len(self.connectors)
        for c, part in zip(self.connectors, parts):
            c.bind_connector_metadata(part)

    def start_load_kv(self) -> None:
        for c in self.connectors:
            c.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer, kv_layer)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        parts = [c.get_finished(finished_req_ids) for c in self.connectors]
        out = KVConnectorOutput()
        for p in parts:
            out.finished_sending.extend(p.finished_sending)
            out.finished_recving.extend(p.finished_recving)
            out.failed_recving.extend(p.failed_recving)
            out.num_loaded_blocks += p.num_loaded_blocks
            out.num_saved_blocks += p.num_saved_blocks
            out.loaded_bytes += p.loaded_bytes
            out.saved_bytes += p.saved_bytes
            out.load_s += p.load_s
            if p.stored_nbytes:
                out.stored_nbytes = {**out.stored_nbytes, **p.stored_nbytes}
        return out
