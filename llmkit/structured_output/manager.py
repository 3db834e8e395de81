"""``StructuredOutputManager``: the engine core's side of structured output (vLLM v1's shape).

- ``grammar_init(request)`` (at admission): the spec's compilation starts in a background
  thread pool, shared through a cache keyed by the spec (an LRU of ``cache_size``); requests
  with the same spec wait for one compilation. The scheduler holds the request in
  ``WAITING_FOR_FSM`` until ``is_ready`` says so — no step ever waits for a compiler.
- ``grammar_bitmask(...)`` (once per step, for the whole batch): one int32 row per logits
  position of each constrained request, filled by the backend's batch fill (1 + K rows for a
  request verifying K draft tokens: the matcher walks the drafts and rolls back).
- ``accept_tokens`` / ``rollback`` (in ``update_from_output``): matchers follow the output;
  ``should_terminate``: the output is complete and only a stop token may follow, so the
  request can end without another step.

The backend (tokenizer info, compiler) is built on first use, in the pool too: an engine that
never sees a constrained request never loads it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from llmkit.config.schema import StructuredOutputConfig
from llmkit.request import Request
from llmkit.structured_output import STRUCTURED_OUTPUT_BACKENDS
from llmkit.structured_output.base import (GrammarCompileError, StructuredOutputBackend,
                                           StructuredOutputGrammar, StructuredOutputKey,
                                           structured_output_key)
from llmkit.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

__all__ = ["StructuredOutputManager"]


def _wait_any(futures: list[Future[Any]], timeout: float) -> None:
    if futures:
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputConfig, *, vocab_size: int,
                 tokenizer_loader: Callable[[], Any], max_rollback_tokens: int = 0) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.backend_cls: type[StructuredOutputBackend] = STRUCTURED_OUTPUT_BACKENDS.resolve(
            config.name, config.target)
        self._tokenizer_loader = tokenizer_loader
        self.num_threads = config.max_compile_threads or max(1, ((os.cpu_count() or 2) + 1) // 2)
        self._pool = ThreadPoolExecutor(max_workers=self.num_threads,
                                        thread_name_prefix="llmkit-grammar")
        self._backend_future: Future[StructuredOutputBackend] | None = None
        # Touched on the engine thread only; the pool only completes the futures.
        self._cache: OrderedDict[StructuredOutputKey, Future[Any]] = OrderedDict()
        # Draft tokens a matcher may have to take back (speculative decoding's K).
        self.max_rollback_tokens = max_rollback_tokens
        # Seconds the latest compilations took in the pool (key -> s, at most cache_size of
        # them), for benchmarks; written by the pool's threads.
        self.compile_times: OrderedDict[StructuredOutputKey, float] = OrderedDict()
        self._times_lock = threading.Lock()

    # -- the backend -----------------------------------------------------------------------------
    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend (built now if no request has needed it yet; blocks until it is)."""
        return self._backend().result()

    def _backend(self) -> Future[StructuredOutputBackend]:
        if self._backend_future is None:
            self._backend_future = self._pool.submit(self._make_backend)
        return self._backend_future

    def _make_backend(self) -> StructuredOutputBackend:
        return self.backend_cls(tokenizer=self._tokenizer_loader(), vocab_size=self.vocab_size,
                                disable_any_whitespace=self.config.disable_any_whitespace,
                                num_threads=self.num_threads)

    # -- admission ---------------------------------------------------------------------------------
    def grammar_init(self, request: Request) -> None:
        """Start (or share) the compilation of ``request``'s grammar."""
        key = structured_output_key(request.sampling_params.structured_outputs)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
        else:
            backend = self._backend()
            future = self._pool.submit(self._compile, backend, key)
            self._cache[key] = future
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)  # requests still hold their own futures
        end = request.sampling_params.structured_outputs.reasoning_end_token_ids
        request.structured_output_request = StructuredOutputRequest(
            key, future, reasoning_end=tuple(end) if end else None)

    def _compile(self, backend: Future[StructuredOutputBackend], key: StructuredOutputKey) -> Any:
        t0 = time.perf_counter()
        compiled = backend.result().compile(key)
        with self._times_lock:
            self.compile_times[key] = time.perf_counter() - t0
            while len(self.compile_times) > self.config.cache_size:
                self.compile_times.popitem(last=False)
        return compiled

    def is_ready(self, request: Request) -> bool:
        """True once the request's grammar is made, or has failed (``error`` says why)."""
        so = request.structured_output_request
        if so.grammar is not None or so.error is not None:
            return True
        if not so.compiled.done():
            return False
        try:
            compiled = so.compiled.result()
            stop_ids = [request.eos_token_id] if request.eos_token_id is not None else []
            stop_ids += request.sampling_params.stop_token_ids
            so.grammar = self._backend().result().new_grammar(compiled, stop_ids,
                                                             self.max_rollback_tokens)
        except GrammarCompileError as e:
            so.error = str(e)
        except Exception as e:  # noqa: BLE001 - a failed compile fails this request alone
            logger.exception("structured output: compiling %s failed", so.key[0].value)
            so.error = f"structured_outputs.{so.key[0].value}: {type(e).__name__}: {e}"
        if so.error is not None and self._cache.get(so.key) is so.compiled:
            del self._cache[so.key]  # let a later request try again
        return True

    def take_ready(self, waiting: list[Request], *, wait: bool = False,
                   timeout: float = 0.01) -> tuple[list[Request], list[Request], list[Request]]:
        """Split requests waiting for their grammar into (ready, failed, still waiting), in
        order. ``wait``: the engine has nothing else to do, so wait up to ``timeout`` s for a
        compilation to finish rather than let the engine loop spin."""
        if wait:
            pending = [r.structured_output_request.compiled for r in waiting
                       if not r.structured_output_request.compiled.done()]
            if len(pending) == len(waiting):
                _wait_any(pending, timeout)
        ready: list[Request] = []
        failed: list[Request] = []
        still: list[Request] = []
        for req in waiting:
            if not self.is_ready(req):
                still.append(req)
            elif req.structured_output_request.error is not None:
                failed.append(req)
            else:
                ready.append(req)
        return ready, failed, still

    # -- one step ----------------------------------------------------------------------------------
    def grammar_bitmask(self, requests: Mapping[str, Request], scheduled: Iterable[str],
                        spec_tokens: Mapping[str, list[int]] | None = None
                        ) -> tuple[list[str], np.ndarray | None]:
        """The step's constrained requests (those of ``scheduled`` that sample a token: a
        prefill chunk short of the prompt's end has no logits) and their bitmask: one row per
        logits position (1 + the request's draft tokens), in that order. Rows of terminated
        grammars allow everything. Called after the step's tokens count as computed."""
        request_ids = [rid for rid in scheduled
                       if (r := requests[rid]).structured_output_request is not None
                       and r.num_computed_tokens >= r.num_tokens]
        if not request_ids:
            return [], None
        spec_tokens = spec_tokens or {}
        backend = self.backend
        num_rows = sum(1 + len(spec_tokens.get(rid, ())) for rid in request_ids)
        bitmask = backend.allocate_bitmask(num_rows)
        batch: list[StructuredOutputGrammar] = []
        batch_rows: list[int] = []
        row = 0
        for rid in request_ids:
            so = requests[rid].structured_output_request
            grammar = so.grammar
            drafts = list(spec_tokens.get(rid, ()))
            start = row
            row += 1 + len(drafts)
            if so.reasoning:
                # Thinking: its rows allow everything, up to the row after a draft that
                # completes the end marker; the grammar constrains the rows from there.
                j = so.reasoning_ends_at(drafts)
                if j is None:
                    continue
                start, drafts = start + j + 1, drafts[j + 1:]
            elif not drafts:
                if not grammar.is_terminated():
                    batch.append(grammar)
                    batch_rows.append(start)
                continue
            # Each draft position sees the grammar after the drafts before it; a draft the
            # grammar refuses is rejected there, so the rows after it stay unconstrained.
            advanced = 0
            for i, tok in enumerate([*drafts, None]):
                if grammar.is_terminated():
                    break
                grammar.fill_bitmask(bitmask, start + i)
                if tok is None or not grammar.accept_tokens([tok]):
                    break
                advanced += 1
            grammar.rollback(advanced)
        backend.fill_bitmasks(batch, bitmask, batch_rows)
        return request_ids, bitmask

    # -- after a step ------------------------------------------------------------------------------
    def accept_tokens(self, request: Request, tokens: list[int]) -> bool:
        """Advance the request's matcher; False if the grammar refuses a token. Tokens of
        the thinking (up to its end marker) pass the matcher by."""
        so = request.structured_output_request
        for i, tok in enumerate(tokens):
            if not so.reasoning:
                return so.grammar.accept_tokens(tokens[i:])
            so.see_reasoning_token(tok)
        return True

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (rejected drafts)."""
        request.structured_output_request.grammar.rollback(num_tokens)

    def should_terminate(self, request: Request) -> bool:
        """The output is complete and only a stop token may come next, and EOS would end the
        request: it may take EOS now instead of sampling it in another step. Not with
        ``logprobs`` (that EOS would have none to report)."""
        sp = request.sampling_params
        if request.structured_output_request.reasoning:
            return False
        if (sp.logprobs is not None or sp.ignore_eos or request.eos_token_id is None
                or request.num_output_tokens + 1 < sp.min_tokens):
            return False
        return request.structured_output_request.grammar.only_stop_tokens_allowed()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend_future is not None and self._backend_future.done() \
                and self._backend_future.exception() is None:
            self._backend_future.result().shutdown()
