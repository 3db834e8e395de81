"""A KV connector's worker-side calls around one step (vLLM's KV-connector runner mixin).

Before the forward the connector learns the step's plan and starts its loads; its per-layer
calls (wait for a layer's loads, hand a layer's KV over) run inside an eager forward, where
the model calls them around each layer (``AttentionMetadata.kv_layer_hook``). Around a step
graph, or a model without the hook, every layer's loads land before the forward and every
layer is handed over after it. A step with no forward still ends its transfers.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from llmkit.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from llmkit.outputs import KVConnectorOutput

T = TypeVar("T")


def start_step(conn: KVConnectorBase, metadata: KVConnectorMetadata | None) -> None:
    conn.bind_connector_metadata(metadata)
    conn.start_load_kv()


def wait_for_all_layers(conn: KVConnectorBase, num_layers: int) -> None:
    for layer in range(num_layers):
        conn.wait_for_layer_load(layer)


def save_all_layers(conn: KVConnectorBase, kv_caches: list[torch.Tensor]) -> None:
    for layer, kv in enumerate(kv_caches):
        conn.save_kv_layer(layer, kv)


def forward_with_connector(conn: KVConnectorBase, kv_caches: list[torch.Tensor],
                           forward: Callable[[bool], T], layer_hook: bool) -> T:
    """``forward(hooked)``'s result: with ``layer_hook`` (an eager forward of a model that
    calls the hook) the forward makes the per-layer calls itself; else they wrap it."""
    if layer_hook:
        return forward(True)
    wait_for_all_layers(conn, len(kv_caches))
    out = forward(False)
    save_all_layers(conn, kv_caches)
    return out


def finish_without_forward(conn: KVConnectorBase, num_layers: int,
                           finished_req_ids: set[str]) -> KVConnectorOutput:
    """A step that computes no token: its transfers end here."""
    wait_for_all_layers(conn, num_layers)
    conn.wait_for_save()
    return conn.get_finished(finished_req_ids)
