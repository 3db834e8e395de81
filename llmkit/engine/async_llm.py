"""AsyncLLM: the asyncio front end of an engine core that runs in its own process.

This process tokenizes, detokenizes (``OutputProcessor``) and streams; the engine core
(scheduler + executor) runs in a child process (``MPClient``) and sees token ids only.

    llm = AsyncLLM("path/or/preset", dtype="float32")
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)          # cumulative by default
    await llm.abort("req-1")                # frees the request's KV blocks at the next step

``n > 1`` fans out in this process (the ``OutputProcessor``, as for the offline ``LLM``) into
``n`` engine requests ``"{i}_{request_id}"`` with ``n=1`` and seed ``seed + i`` when a seed is
given (vLLM's rule); the engine's prefix cache shares their prompt blocks. Their outputs come
back merged under the request's id, each ``CompletionOutput`` with its ``index``.

The engine process is started with ``multiprocessing``'s spawn method, which re-imports the
main module: a script that creates an AsyncLLM must guard its entry point with
``if __name__ == "__main__":``.

Admission: at most ``max_waiting_requests`` engine requests may wait for their first token
(queued in the engine or being prefilled); beyond that ``add_request`` raises
``EngineOverloadedError`` (the server answers 503). When the engine process dies, every stream
in flight raises ``EngineDeadError`` and so does every new request.

Metrics hooks (``StatLogger``) see, per engine request: time to first token (from
``add_request`` here, so it includes tokenization and queueing), inter-token latency, end-to-end
latency, the engine's queue time (first scheduled − arrival at the core), prompt and generated
token counts, finish reason; and the engine's stats snapshot after each step.

The requests in flight are followed by a ``RequestTracker`` (``request_tracker.py``), which
routes the engine's outputs to each request's ``RequestStream`` (the same module).

Data parallel (``parallel.data_parallel_size = N``): ``engine_core`` is a ``DPClient`` of N
engine core processes; each request (all its ``n`` samples) goes to the core its router picks
and stays there (``dp/client.py``, ``dp/router.py``); the stats are summed over the cores. A
core that dies fails only its own requests in flight; the engine then counts as dead (503)
until ``restart_engine_core`` has replaced the dead core(s).

Live views: ``step_feed`` (an ``EngineStepFeed``) keeps the engine core's per-step summaries
(``observe/step_summary.py``); ``await engine_snapshot(check_kv=True)`` asks the core for its
state now, with a KV-cache integrity check. ``await restart_engine_core()`` replaces a dead engine core
process with a new one (the server does it when ``server.restart_engine`` is set).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import AsyncGenerator, Sequence

from llmkit.config.compose import build_config
from llmkit.config.schema import EngineConfig
from llmkit.engine.beam_search import (BeamSearchParams, first_logprobs, run_beam_search_async,
                                       start_beam_search)
from llmkit.engine.client import EngineProcessClient
from llmkit.engine.process.client import (EngineDeadError, EngineStartupError, MPClient,
                                          start_engine_core)
from llmkit.engine.dp.client import DPClient, start_engine_cores
from llmkit.engine.process.core import EngineCoreOutputs, EngineCoreRequest, encode_sampling_params
from llmkit.engine.frontend import Frontend, FrontendModel, Message, PromptType
from llmkit.engine.output_processor import OutputProcessor, RequestOutputKind
from llmkit.engine.request_tracker import RequestStream, RequestTracker, SLORejectedError
from llmkit.engine.observe.stat_logger import StatLogger
from llmkit.lora.request import LoRARequest
from llmkit.engine.observe.step_summary import EngineStepFeed, EngineStepSummary
from llmkit.outputs import EmbeddingRequestOutput, RequestOutput
from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.base import SchedulerStats

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineStartupError",
           "RequestOutputKind", "RequestStream", "SLORejectedError", "StatLogger",
           "start_engine_core",
           "start_engine_cores"]

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests wait for their first token; try again later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AsyncLLM:
    """An engine core in a child process behind an asyncio API (see the module docstring).

    ``AsyncLLM(model, dtype=..., overrides=[...], **groups)`` composes the config as ``LLM``
    does; ``AsyncLLM.from_config(config)`` takes a validated ``EngineConfig``. Construction
    blocks until the engine process has loaded the model.
    """

    def __init__(self, model: str | None = None, *, dtype: str | None = None,
                 overrides: Sequence[str] = (), stat_logger: StatLogger | None = None,
                 quantization: str | None = None, **groups: str | dict) -> None:
        config = build_config(model, dtype=dtype, overrides=overrides, groups=groups,
                              quantization=quantization)
        self._init_from_config(config, stat_logger)

    @classmethod
    def from_config(cls, config: EngineConfig, *, stat_logger: StatLogger | None = None,
                    engine_core: EngineProcessClient | None = None) -> "AsyncLLM":
        """``engine_core``: the engine process(es) already started with
        ``start_engine_cores`` (so that they load the model while this process imports and
        loads the tokenizer)."""
        llm = cls.__new__(cls)
        llm._init_from_config(config, stat_logger, engine_core)
        return llm

    def _init_from_config(self, config: EngineConfig, stat_logger: StatLogger | None,
                          engine_core: EngineProcessClient | None = None) -> None:
        # The engine process starts first and loads the model while this process loads the
        # tokenizer.
        if engine_core is None:
            engine_core = start_engine_cores(config)
        engine_config = engine_core.config
        self.config = config
        self.max_waiting_requests = config.server.max_waiting_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._shutdown = False
        self.engine_core = engine_core
        # a replacement engine core while it loads (data parallel: the client restarting its
        # dead cores)
        self._starting: EngineProcessClient | None = None
        self.num_engine_restarts = 0
        self.step_feed = EngineStepFeed()
        try:
            model = FrontendModel.load(engine_config.model)
            self.model_source = model.source
            self.tokenizer = model.tokenizer
            # What requests that leave a sampling field unset get (vLLM's generation config).
            self.default_sampling_fields = model.default_sampling_fields
            outputs = OutputProcessor(model.tokenizer)
            self._tracker = RequestTracker(outputs, engine_core, stat_logger)
            # Before wait_ready, which starts the client's reader thread (the engine sends
            # nothing before its first request, so nothing is missed meanwhile).
            engine_core.set_handlers(on_message=self._on_message_threadsafe,
                                     on_death=self._on_death_threadsafe,
                                     on_summary=self._on_summary_threadsafe,
                                     on_requests_lost=self._on_lost_threadsafe)
            self.engine_core.wait_ready()
        except BaseException:
            self.engine_core.shutdown(timeout=2.0)
            raise
        # The engine's own facts (what it reported when ready) check every request here.
        self.model_facts = self.engine_core.model_facts
        self.max_model_len = self.model_facts.max_model_len
        self.vocab_size = self.model_facts.vocab_size
        self.frontend = Frontend(engine_config, model, self.model_facts, outputs=outputs)

    # -- state ------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self.engine_core.is_dead

    @property
    def errored(self) -> bool:
        return self.engine_core.is_dead

    @property
    def restarting(self) -> bool:
        """A new engine core process is loading (``restart_engine_core``)."""
        return self._starting is not None

    @property
    def dead_error(self) -> EngineDeadError:
        return self.engine_core.dead_error or EngineDeadError("the engine core has shut down")

    @property
    def num_pending_requests(self) -> int:
        """Engine requests that wait for their first token."""
        return self._tracker.num_pending

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracker.tracked)

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The engine's stats after its latest step."""
        return self._tracker.last_stats

    @property
    def stat_logger(self) -> StatLogger | None:
        return self._tracker.stat_logger

    @stat_logger.setter
    def stat_logger(self, value: StatLogger | None) -> None:
        self._tracker.stat_logger = value

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: the model's recommended defaults
        (``model.generation_config``) over ``SamplingParams``' own (as ``LLM``'s)."""
        return self.frontend.default_sampling_params()

    # -- requests ---------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed() and self._tracker.tracked:
            raise RuntimeError("AsyncLLM is serving requests from another event loop")
        self._loop = loop

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams | None = None, *,
                          n: int | None = None, priority: int = 0,
                          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                          prompt_text: str | None = None,
                          cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None,
                          pooling: bool = False) -> RequestStream:
        """Validate, admit and send a request; return its stream. Raises ``ValueError`` (bad
        input: empty or too long a prompt, token ids outside the vocabulary, duplicate id),
        ``EngineOverloadedError`` (queue full) or ``EngineDeadError``, before anything is
        sent. ``n`` overrides ``sampling_params.n``. ``lora_request``: the adapter to run
        with (the engine loads it the first time it is named; a bad one fails this request)."""
        self._bind_loop()
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got "
                            f"{type(lora_request).__name__}")
        if self._shutdown:
            raise EngineDeadError("the engine is shutting down")
        if self.engine_core.is_dead:
            raise self.dead_error
        if request_id in self._tracker.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # pooling: a request for the prompt's embedding (``embed``), not for tokens
        p = (self.frontend.process_embedding(prompt, cache_salt=cache_salt) if pooling else
             self.frontend.process(prompt, self.frontend.sampling_params(sampling_params, n),
                                   cache_salt=cache_salt))
        ids, params, cache_salt, mm_features = p.token_ids, p.params, p.cache_salt, p.mm_features
        num_pending = self._tracker.num_pending
        if num_pending + params.n > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {num_pending} requests wait for their first "
                f"token (server.max_waiting_requests={self.max_waiting_requests}); retry later")
        # The output processor fans n > 1 out into children "{i}_{id}" with seeds seed + i.
        children = self.frontend.fan_out(request_id, p, output_kind, prompt_text)
        try:
            # Encode first: a parameter that cannot cross to the engine fails before any
            # request is sent.
            encoded = self.engine_core.encode_requests([EngineCoreRequest(
                cid, ids, encode_sampling_params(cp), priority=priority, cache_salt=cache_salt,
                lora_request=lora_request, mm_features=mm_features)
                for cid, cp in children])
        except Exception:
            self._tracker.drop_processor_state([cid for cid, _ in children])
            raise
        stream = RequestStream(self._tracker, request_id, [cid for cid, _ in children])
        self._tracker.open(stream)
        for cid, _ in children:
            self._tracker.track(cid, stream, len(ids))
        # All n samples go to one engine core (data parallel: the one the router picks).
        self.engine_core.send_requests(encoded)
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, n: int | None = None,
                       priority: int = 0,
                       output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                       cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes (cumulative by default; ``DELTA``
        yields only what is new). Leaving the loop early (break, cancellation, an error)
        aborts the request."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = await self.add_request(request_id, prompt, sampling_params, n=n,
                                        priority=priority, output_kind=output_kind,
                                        cache_salt=cache_salt, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def embed(self, prompt: PromptType, request_id: str | None = None, *,
                    priority: int = 0, lora_request: LoRARequest | None = None
                    ) -> EmbeddingRequestOutput:
        """The prompt's embedding (``model.runner=pooling``; a generating engine raises
        ``ValueError``), as ``LLM.embed`` gives it."""
        if request_id is None:
            request_id = f"embd-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = await self.add_request(request_id, prompt, priority=priority,
                                        output_kind=RequestOutputKind.FINAL_ONLY,
                                        lora_request=lora_request, pooling=True)
        try:
            async for out in stream:
                if isinstance(out, EmbeddingRequestOutput):
                    return out
            raise RuntimeError(f"request {request_id!r} ended without its embedding (aborted)")
        finally:
            stream.abort()

    async def chat(self, messages: Sequence[Message],
                   sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, **kwargs) -> AsyncGenerator[RequestOutput, None]:
        prompt = self.frontend.chat_prompt(messages)
        async for out in self.generate(prompt, sampling_params, request_id, **kwargs):
            yield out

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams,
                          *, priority: int = 0, cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None
                          ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's ``EngineClient.beam_search`` (``llmkit.engine.beam_search``): yields one
        finished ``RequestOutput``, a ``CompletionOutput`` per beam, best first. Each step's
        beams run as requests ``"{request_id}-{step}-{beam}"``."""
        search = start_beam_search(self.frontend, prompt, params, cache_salt)
        step = params.step_params(self.model_facts.vocab_size)

        async def step_one(beam_prompt, num_step: int, beam: int):
            last = None
            async for out in self.generate(beam_prompt, step, f"{request_id}-{num_step}-{beam}",
                                           priority=priority, lora_request=lora_request,
                                           output_kind=RequestOutputKind.FINAL_ONLY):
                last = out
            return first_logprobs(last)

        await run_beam_search_async(search, step_one)
        yield search.request_output(request_id, self.tokenizer)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """The prompt token ids of a conversation, by the model's chat template."""
        return self.frontend.apply_chat_template(messages, add_generation_prompt,
                                                 **template_kwargs)

    # -- LoRA adapters ------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the engine now (it checks the files against the model); False
        if it already was. Raises ``ValueError`` with the engine's reason."""
        return bool(await self._call("add_lora", lora_request.lora_name,
                                     lora_request.lora_int_id, lora_request.lora_path))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (the engine forgets it once no request uses it)."""
        return bool(await self._call("remove_lora", lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        return [LoRARequest(*item) for item in await self._call("list_loras")]

    async def _call(self, method: str, *args):
        if self.engine_core.is_dead:
            raise self.dead_error
        return await asyncio.wrap_future(self.engine_core.call_utility(method, *args))

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (by the id given to ``generate``); the engine frees their blocks
        before its next step. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._tracker.streams.get(rid)
            if stream is not None:
                stream.abort()
            elif rid in self._tracker.tracked:
                self._tracker.abort_local([rid])

    # -- the engine's messages (reader thread → event loop) --------------------------------
    def _on_message_threadsafe(self, msg: EngineCoreOutputs) -> None:
        """Called in the client's reader thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            if msg.stats is not None:
                self._tracker.on_stats(msg.stats)
            return
        try:
            loop.call_soon_threadsafe(self._tracker.handle_outputs, msg)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _on_death_threadsafe(self, err: EngineDeadError) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._tracker.fail_all, err)
            loop.call_soon_threadsafe(self.step_feed.fail, err)
        except RuntimeError:
            pass

    def _on_lost_threadsafe(self, request_ids: list[str], err: EngineDeadError) -> None:
        """One of several engine cores died with these engine requests (reader thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._tracker.fail_requests, request_ids, err)
            loop.call_soon_threadsafe(self.step_feed.fail, err)  # the engine counts as dead
        except RuntimeError:
            pass

    def _on_summary_threadsafe(self, summary: EngineStepSummary) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self.step_feed.latest = summary  # nobody listens in a loop yet
            return
        try:
            loop.call_soon_threadsafe(self.step_feed.publish, summary)
        except RuntimeError:
            pass

    # -- live views -------------------------------------------------------------------------
    async def engine_snapshot(self, check_kv: bool = False,
                              timeout: float = 10.0) -> EngineStepSummary:
        """The engine core's state now (answered between two steps); with ``check_kv``, also
        ``KVCacheManager.check_integrity()``'s verdict (``kv_integrity_error`` None = sound).
        Raises ``EngineDeadError`` if the engine is not running, ``TimeoutError`` if it does
        not answer within ``timeout`` s."""
        self._bind_loop()
        if not self.is_running:
            raise self.dead_error
        qid, fut = self.step_feed.new_query(asyncio.get_running_loop())
        try:
            self.engine_core.request_snapshot(qid, check_kv)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.step_feed.drop_query(qid)

    async def restart_engine_core(self, startup_timeout: float = 900.0) -> None:
        """Replace a dead engine core process with a new one (same config, same resolved
        model) and serve again. Requests in flight have already failed with
        ``EngineDeadError``; new ones are refused until the new core is ready. Raises
        ``EngineStartupError`` if it fails to start (the old, dead one stays in place)."""
        self._bind_loop()
        old = self.engine_core
        if self._shutdown:
            raise EngineDeadError("the engine is shutting down")
        if not old.is_dead:
            raise RuntimeError("the engine core is alive; nothing to restart")
        if self._starting is not None:
            raise RuntimeError("a restart is already under way")
        if isinstance(old, DPClient):  # data parallel: new processes for the dead cores only
            self._starting = old
            try:
                await asyncio.to_thread(old.restart_dead_cores, startup_timeout)
            finally:
                self._starting = None
            self.num_engine_restarts += 1
            return
        new = MPClient(old.config, wait=False)
        self._starting = new
        try:
            new.set_handlers(on_message=self._on_message_threadsafe,
                             on_death=self._on_death_threadsafe,
                             on_summary=self._on_summary_threadsafe)
            await asyncio.to_thread(new.wait_ready, startup_timeout)
            if self._shutdown:  # the server stopped while the new core loaded
                await asyncio.to_thread(new.shutdown, 2.0)
                raise EngineDeadError("the engine is shutting down")
        finally:
            self._starting = None
        self._tracker.fail_all(old.dead_error)  # nothing should be left; be sure
        self.engine_core = new
        self._tracker.engine_core = new
        self._tracker.last_stats = None
        self.max_model_len = new.max_model_len
        self.num_engine_restarts += 1
        await asyncio.to_thread(old.shutdown, 1.0)

    # -- shutdown ---------------------------------------------------------------------------
    def fail_in_flight(self, message: str = "the server is shutting down") -> None:
        """End every stream in flight with ``EngineDeadError`` and abort it in the engine
        (call in the event loop)."""
        ids = list(self._tracker.tracked)
        self._tracker.fail_all(EngineDeadError(message))
        if ids:
            try:
                self.engine_core.abort_requests(ids)
            except Exception:  # noqa: BLE001
                pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (ask, wait ``timeout`` s, terminate, kill). Idempotent;
        blocking: from a coroutine use ``await asyncio.to_thread(llm.shutdown)``."""
        self._shutdown = True
        starting = self._starting
        if starting is not None:
            starting.shutdown(timeout=1.0)
        self.engine_core.shutdown(timeout=timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
