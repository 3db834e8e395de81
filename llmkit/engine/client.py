"""What a front end may ask of an engine: the typed protocols ``LLM`` and ``AsyncLLM`` program
against, so that neither probes the object it was handed.

An engine is reached in one of three ways, all behind ``EngineClient``:

- in this process: ``EngineCore`` itself (no forwarding layer), stepped by the caller;
- one engine core process: ``MPClient`` (``process.client``), over ZMQ;
- several (data parallel): ``DPClient`` (``dp.client``) over N ``MPClient``s, and for the
  offline ``LLM`` ``DataParallelEngine`` (``dp.engine``), which steps a ``DPClient``.

The two refinements differ in who runs the loop. A ``SteppedEngineClient`` runs when the caller
calls ``step()`` and answers with the outputs (``LLM``: ``EngineCore``,
``DataParallelEngine``); an ``EngineProcessClient``'s cores run on their own and report through
handlers called in a reader thread (``AsyncLLM``: ``MPClient``, ``DPClient``).
``tests/test_engine_client.py`` checks that each implementation has every member.
(``process.client.InprocClient`` speaks the process clients' wire types in this process, for
tests of those types; no front end drives it.)
"""
from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence, runtime_checkable

from llmkit.facts import ModelFacts
from llmkit.lora.request import LoRARequest
from llmkit.outputs import EngineCoreOutput
from llmkit.request import Request
from llmkit.scheduler.base import SchedulerStats

if TYPE_CHECKING:
    from llmkit.config.schema import EngineConfig
    from llmkit.engine.process.client import (EncodedRequests, EngineDeadError, OnDeath, OnMessage,
                                              OnRequestsLost, OnSummary)
    from llmkit.engine.process.core import EngineCoreRequest, EngineReady

__all__ = ["EngineClient", "EngineProcessClient", "SteppedEngineClient"]


@runtime_checkable
class EngineClient(Protocol):
    """Every engine, wherever its core(s) run: the model it serves and how to stop it."""

    @property
    def model_facts(self) -> ModelFacts:
        """The served model's limits (max_model_len, vocabulary, EOS ids): what the front end
        checks every prompt against."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class SteppedEngineClient(EngineClient, Protocol):
    """An engine the caller steps (``LLM``): ``EngineCore`` in this process, or
    ``DataParallelEngine`` over engine core processes."""

    def clock(self) -> float:
        """The engine's time (a request's arrival time is read from it)."""
        ...

    def add_requests(self, requests: Sequence[Request]) -> None:
        """One user request's engine requests (its ``n`` samples): kept together (on one
        core, under data parallel) so that they share their prompt's blocks."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        ...

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort now; the aborted requests' final outputs come back."""
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    def stats(self) -> SchedulerStats:
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (False if it already is); a ``ValueError`` for files that do not
        fit the model."""
        ...

    def remove_lora(self, lora_id: int) -> bool:
        ...

    def list_loras(self) -> list[LoRARequest]:
        ...


@runtime_checkable
class EngineProcessClient(EngineClient, Protocol):
    """Engine core process(es) that run on their own (``AsyncLLM``): ``MPClient`` for one,
    ``DPClient`` for several. Outputs, step summaries and deaths arrive through the handlers
    (``set_handlers``, called in a reader thread)."""

    config: "EngineConfig"
    ready: "EngineReady | None"  # what the (first) core reported when ready

    def set_handlers(self, on_message: "OnMessage | None", on_death: "OnDeath | None",
                     on_summary: "OnSummary | None" = None,
                     on_requests_lost: "OnRequestsLost | None" = None) -> None:
        ...

    def wait_ready(self, timeout: float = 900.0) -> "EngineReady":
        ...

    @property
    def is_dead(self) -> bool:
        ...

    @property
    def dead_error(self) -> "EngineDeadError | None":
        ...

    @property
    def pids(self) -> list[int]:
        """The engine core processes' ids."""
        ...

    def core_states(self) -> list[tuple[bool, SchedulerStats | None]]:
        """Each data-parallel core's (alive, latest stats); empty for one core."""
        ...

    def encode_requests(self, requests: "list[EngineCoreRequest]") -> "EncodedRequests":
        """One user request's engine requests, encoded (raises for values that cannot cross,
        before anything is sent)."""
        ...

    def send_requests(self, encoded: "EncodedRequests") -> None:
        ...

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ...

    def call_utility(self, method: str, *args) -> concurrent.futures.Future:
        """Run one of ``process.core.UTILITY_METHODS`` (LoRA adapters) on the core(s)."""
        ...

    def request_snapshot(self, query_id: int, check_kv: bool = False) -> None:
        ...
