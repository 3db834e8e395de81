"""``DataParallelEngine``: what the offline ``LLM`` drives when
``parallel.data_parallel_size > 1`` — a ``SteppedEngineClient`` (``add_requests``, ``step``,
``abort_requests``, ``stats``, LoRA adapters; ``llmkit.engine.client``) over a ``DPClient`` of
engine core processes.

The cores run on their own; ``step()`` returns the outputs that arrived from any of them since
the last call (waiting for at least one batch while requests are unfinished). ``stats()`` sums
the cores' latest stats. A core that dies makes the next ``step()`` raise ``EngineDeadError``
naming it (its requests cannot finish); a request a core refused raises ``ValueError``.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from llmkit.config.schema import EngineConfig
from llmkit.engine.process.client import EngineDeadError, with_resolved_model
from llmkit.engine.process.core import EngineCoreOutputs, EngineCoreRequest, encode_sampling_params
from llmkit.engine.dp.client import DPClient
from llmkit.engine.dp.stats import combine_scheduler_stats
from llmkit.facts import ModelFacts
from llmkit.lora.request import LoRARequest
from llmkit.outputs import EngineCoreOutput
from llmkit.request import Request
from llmkit.scheduler.base import SchedulerStats

__all__ = ["DataParallelEngine"]

# How long step() waits for outputs before it looks at the cores' health again (s).
_POLL_S = 0.5


@dataclass(slots=True)
class _Lost:
    request_ids: list[str]
    error: EngineDeadError


class DataParallelEngine:
    """A ``SteppedEngineClient`` over several engine core processes (module docstring)."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 900.0) -> None:
        self.config = config
        self.client = DPClient(with_resolved_model(config), wait=False)
        self._inbox: queue.Queue = queue.Queue()
        self.client.set_handlers(on_message=self._inbox.put, on_death=None,
                                 on_requests_lost=lambda ids, err: self._inbox.put(
                                     _Lost(ids, err)))
        self.client.wait_ready(startup_timeout)
        self.model_facts: ModelFacts = self.client.model_facts
        self.max_model_len = self.client.max_model_len
        self.eos_token_id = self.client.eos_token_id
        self.num_blocks = sum(self.client.num_blocks)
        self.clock = time.monotonic
        self._unfinished: set[str] = set()
        self._loras: dict[int, LoRARequest] = {}

    @property
    def num_cores(self) -> int:
        return self.client.num_cores

    # -- requests ---------------------------------------------------------------------------
    def add_requests(self, requests: Sequence[Request]) -> None:
        """One user request's engine requests (its ``n`` samples): routed to one core."""
        if self.client.is_dead:
            raise self.client.dead_error
        wire = [self._to_wire(r) for r in requests]
        self.client.send_requests(self.client.encode_requests(wire))
        self._unfinished.update(r.request_id for r in requests)

    def _to_wire(self, r: Request) -> EngineCoreRequest:
        lora = None
        if r.lora_id is not None:
            lora = self._loras.get(r.lora_id)
            if lora is None:
                raise ValueError(f"LoRA adapter id {r.lora_id} is not loaded (add_lora first)")
        return EngineCoreRequest(r.request_id, r.prompt_token_ids,
                                 encode_sampling_params(r.sampling_params),
                                 priority=r.priority, cache_salt=r.cache_salt,
                                 lora_request=lora, mm_features=list(r.mm_features))

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort now: the aborted requests' final outputs come back at once (as
        ``EngineCore.abort_requests``'); what their cores still send for them is dropped."""
        ids = [rid for rid in request_ids if rid in self._unfinished]
        self._unfinished.difference_update(ids)
        if ids and not self.client.is_dead:
            self.client.abort_requests(ids)
        return [EngineCoreOutput(rid, [], finish_reason="abort") for rid in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs every core sent since the last call (at least one batch while requests
        are unfinished)."""
        if not self._unfinished:
            return []
        messages = []
        while not messages:
            try:
                messages.append(self._inbox.get(timeout=_POLL_S))
            except queue.Empty:
                # (a core's death arrives as _Lost; this is the belt to those braces)
                if all(c.is_dead for c in self.client.cores) and self._inbox.empty():
                    raise self.client.dead_error from None
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        outputs: list[EngineCoreOutput] = []
        for msg in messages:
            if isinstance(msg, _Lost):
                lost = [rid for rid in msg.request_ids if rid in self._unfinished]
                if lost:  # requests of this LLM were on the dead core: they cannot finish
                    self._unfinished.difference_update(lost)
                    raise msg.error
                continue
            outputs.extend(self._accept(msg))
        return outputs

    def _accept(self, msg: EngineCoreOutputs) -> list[EngineCoreOutput]:
        for rid, err in msg.errors.items():
            if rid in self._unfinished:
                self._unfinished.discard(rid)
                raise ValueError(f"the engine refused request {rid!r}: {err}")
        out = []
        for o in msg.outputs:
            if o.request_id not in self._unfinished:
                continue  # aborted here already
            if o.finish_reason is not None:
                self._unfinished.discard(o.request_id)
            out.append(o)
        return out

    def stats(self) -> SchedulerStats:
        """The sum of the cores' latest stats (``stats``)."""
        combined = combine_scheduler_stats(self.client.per_core_stats, self.client.num_blocks)
        return combined or SchedulerStats(0, 0, 0.0, 0, 0, 0)

    # -- LoRA adapters (every core loads them) ----------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        if self._loras.get(lora_request.lora_int_id) == lora_request:
            return False  # every core has it (LLM names the adapter with each request)
        added = bool(self.client.call_utility("add_lora", lora_request.lora_name,
                                              lora_request.lora_int_id,
                                              lora_request.lora_path).result())
        self._loras[lora_request.lora_int_id] = lora_request
        return added

    def remove_lora(self, lora_id: int) -> bool:
        self._loras.pop(lora_id, None)
        return bool(self.client.call_utility("remove_lora", lora_id).result())

    def list_loras(self) -> list[LoRARequest]:
        return [LoRARequest(*item) for item in self.client.call_utility("list_loras").result()]

    def shutdown(self) -> None:
        self.client.shutdown()
