"""Which id each adapter gets, and which adapters an engine serves to whom: plain bookkeeping,
no torch (the engine-core process and the API server read it before torch loads).

``configured_adapters`` is the one numbering of ``lora.modules`` (ids 1..n in order) and
``runtime_adapter_ids`` the ids after them: the engine registers the configured adapters under
those ids and the OpenAI layer names them by the same, so a request for an adapter by name
reaches the weights the engine loaded under that name. ``AdapterTable`` is the engine's side:
the adapters registered by id, how many unfinished requests use each, and those removed while
requests still use them (the workers forget them once the last such request finishes).
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator, Protocol

from llmkit.config.schema import LoRAConfig
from llmkit.lora.request import LoRARequest, id_taken_message


def configured_adapters(lora: LoRAConfig) -> list[LoRARequest]:
    """``lora.modules`` as requests, ids 1..n in the order they are listed (none when LoRA is
    off)."""
    if not lora.enabled:
        return []
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora.module_list())]


def runtime_adapter_ids(lora: LoRAConfig) -> Iterator[int]:
    """The ids for adapters loaded at run time: those after the configured ones."""
    return itertools.count(len(configured_adapters(lora)) + 1)


class _Finished(Protocol):
    request_id: str
    finish_reason: object


class AdapterTable:
    """The adapters an engine serves and their users. ``load``/``unload`` reach the workers
    (the executor's ``add_lora``/``remove_lora``)."""

    def __init__(self, enabled: bool, load: Callable[[LoRARequest], None],
                 unload: Callable[[int], object]) -> None:
        self.enabled = enabled
        self._load = load
        self._unload = unload
        self.loras: dict[int, LoRARequest] = {}
        self._lora_of_request: dict[str, int] = {}
        self._users: dict[int, int] = {}
        self._removals: set[int] = set()

    @property
    def in_use(self) -> bool:
        """Whether an unfinished request uses an adapter (a step's outputs need releasing)."""
        return bool(self._lora_of_request)

    def add(self, lr: LoRARequest) -> bool:
        """Register an adapter and load it in the workers (which check its files against the
        model). False if it was already registered. Raises ``ValueError`` (a ``LoRALoadError``
        for bad files) when LoRA is off, or the id or name is another adapter's."""
        if not self.enabled:
            raise ValueError("LoRA adapters need lora.enabled=true")
        known = self.loras.get(lr.lora_int_id)
        if known is not None:
            if known != lr:
                raise ValueError(id_taken_message(known, lr))
            return False
        for other in self.loras.values():
            if other.lora_name == lr.lora_name:
                raise ValueError(f"an adapter named {lr.lora_name!r} is already loaded (id "
                                 f"{other.lora_int_id}); unload it first or pick another name")
        self._load(lr)
        self.loras[lr.lora_int_id] = lr
        self._removals.discard(lr.lora_int_id)
        return True

    def remove(self, lora_id: int) -> bool:
        """Unregister an adapter; the workers forget it once no unfinished request uses it.
        False if it was not registered."""
        if self.loras.pop(lora_id, None) is None:
            return False
        if self._users.get(lora_id, 0):
            self._removals.add(lora_id)
        else:
            self._unload(lora_id)
        return True

    def list(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def name_of(self, request_id: str, lora_id: int) -> str:
        """The name of adapter ``lora_id`` that request ``request_id`` asks for; a
        ``ValueError`` if it is not registered."""
        lr = self.loras.get(lora_id)
        if lr is None:
            raise ValueError(f"request {request_id!r}: LoRA adapter id {lora_id} is not loaded "
                             "(add it with add_lora first)")
        return lr.lora_name

    def hold(self, request_id: str, lora_id: int) -> None:
        """Count the request as a user of the adapter until its final output."""
        self._lora_of_request[request_id] = lora_id
        self._users[lora_id] = self._users.get(lora_id, 0) + 1

    def release(self, outputs: Iterable[_Finished]) -> None:
        """Drop the finished requests' holds; unload an adapter removed meanwhile once its last
        user finishes."""
        for out in outputs:
            if out.finish_reason is None:
                continue
            lora_id = self._lora_of_request.pop(out.request_id, None)
            if lora_id is None:
                continue
            left = self._users[lora_id] = self._users[lora_id] - 1
            if not left:
                del self._users[lora_id]
                if lora_id in self._removals:
                    self._removals.discard(lora_id)
                    self._unload(lora_id)
