"""The ``lora`` section: multi-LoRA serving."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from llmkit.config.sections.strict import _Strict

__all__ = ["LoRAConfig"]


class LoRAConfig(_Strict):
    """Multi-LoRA serving (``llmkit/lora/``): PEFT adapters applied per request, many in a batch.

    A *slot* is one adapter's room in every LoRA layer's stacked buffers, bought at start-up:
    ``max_loras`` slots of ``max_lora_rank`` (A and B of every q/k/v/o/gate/up/down projection,
    the LM head and the embedding), whatever adapters are loaded. The engine logs a slot's size.
    """

    enabled: bool = False
    # Adapters resident in the model's stacked buffers at once: at most this many distinct
    # adapters run in one step (others wait their turn; nothing is refused for lack of a slot).
    max_loras: int = Field(default=4, ge=1)
    # The largest adapter rank accepted (the buffers' width: a slot's cost grows with it).
    max_lora_rank: int = Field(default=16, ge=1)
    # Adapters kept loaded in (CPU) memory, LRU; null = max_loras. Evicted ones are read from
    # their folder again when needed.
    max_cpu_loras: int | None = Field(default=None, ge=1)
    # Adapters loaded at start, "name=path" (a PEFT folder); their ids are 1, 2, ... in order.
    modules: list[str] = Field(default_factory=list)
    # The server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: the routes do
    # not exist).
    allow_runtime_updates: bool = False
    # Folders under which runtime loads may read adapters (a path outside, or with "..", is
    # refused with 403). Empty = every runtime load is refused.
    allowed_paths: list[str] = Field(default_factory=list)
    # Starvation bound: a waiting request passed over this many steps because its adapter had
    # no free slot stops requests queued behind it from being admitted until it is.
    max_skipped_steps: int = Field(default=8, ge=1)
    # The adapter (a lora.modules name) `llmkit generate` and `llmkit chat` run with; null =
    # the base model. (The server and LLM pick an adapter per request.)
    cli_adapter: str | None = None

    @field_validator("modules")
    @classmethod
    def _name_equals_path(cls, v: list[str]) -> list[str]:
        names = set()
        for item in v:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"each entry must be name=path (a PEFT adapter folder), got "
                                 f"{item!r}")
            if name in names:
                raise ValueError(f"adapter name {name!r} appears twice")
            names.add(name)
        return v

    @model_validator(mode="after")
    def _cpu_holds_slots(self) -> "LoRAConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                             f"lora.max_loras ({self.max_loras})")
        if not self.enabled and (self.modules or self.allow_runtime_updates):
            raise ValueError("lora.modules and lora.allow_runtime_updates need "
                             "lora.enabled=true")
        if self.cli_adapter is not None:
            names = [name for name, _ in self.module_list()]
            if self.cli_adapter not in names:
                raise ValueError(f"lora.cli_adapter {self.cli_adapter!r} is not an adapter of "
                                 f"lora.modules (names: {', '.join(names) or 'none'})")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def module_list(self) -> list[tuple[str, str]]:
        """``lora.modules`` as ``(name, path)`` pairs, in order."""
        return [tuple(item.split("=", 1)) for item in self.modules]  # type: ignore[misc]
