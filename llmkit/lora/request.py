"""What names an adapter in a request: plain data, importable without torch (the engine-core
process reads it before it sets OpenMP's wait policy and loads torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` (>= 1) identifies the adapter's weights: two requests with the same id
    share KV blocks, with different ids none. One engine refuses a second adapter under an id
    it already knows (by name or path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty string, got "
                             f"{self.lora_path!r}")


def id_taken_message(known: LoRARequest, request: LoRARequest) -> str:
    """Why ``request`` cannot be registered: its ``lora_int_id`` already names ``known``."""
    return (f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} "
            f"({known.lora_path}); give another adapter another id")


class LoRALoadError(ValueError):
    """An adapter that cannot be served (bad files, modules or shapes); the message says why."""
