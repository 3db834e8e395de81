"""Responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}``: each
with the conversation it ends (the chat messages of every turn so far, its own output as the
last assistant turn), the oldest dropped past ``server.responses_store_size``."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llmkit.entrypoints.openai.responses_protocol import ResponseObject

__all__ = ["ResponsesStore", "StoredResponse"]


@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject
    # The chat messages up to and including this response's output (without `instructions`:
    # a later request's own instructions replace them, as OpenAI does).
    conversation: list[dict[str, Any]]


class ResponsesStore:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, item: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        self._items[item.response.id] = item
        self._items.move_to_end(item.response.id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)  # in use: keep it longer
        return item

    def __len__(self) -> int:
        return len(self._items)
