"""Turns the core's per-step token outputs into user-facing RequestOutputs.

Per engine request (a child of a user request, see ``ParentRequest`` below): detokenize
incrementally, match stop strings on the text as it grows, turn logprob lists into
``{token_id: Logprob}`` dicts, and build the ``CompletionOutput`` for the request's output kind.

Incremental detokenization uses the `tokenizers` library's DecodeStream, which holds back bytes
until they form whole characters (byte-level BPE splits multi-byte characters across tokens).
The stream is primed with the prompt's last tokens so that the first output token decodes with
its context (leading spaces of SentencePiece-style vocabularies).
``spaces_between_special_tokens`` only affects slow (Python) tokenizers; fast ones, the only
kind llmkit detokenizes with, ignore it, as they do in vLLM and transformers.

A stop string is found here, not in the core: the request is finished in the front end and
the core still runs it. ``process(outputs, reqs_to_abort)`` appends such engine request ids to
the caller's list; the caller aborts them in the core so that their KV blocks are freed at
once (an output with ``finished=True`` whose engine output was not finished says the same).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from llmkit.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                            EngineCoreOutput, Logprob, LogprobsLists, RequestOutput)
from llmkit.sampling.params import RequestOutputKind, SamplingParams
from llmkit.sampling.stop_strings import find_stop_string, holdback_chars

__all__ = ["IncrementalDetokenizer", "OutputProcessor", "ParentRequest", "RequestOutputKind",
           "RequestState", "TokenTexts", "child_params", "child_request_id"]

_PRIME_TOKENS = 6


# -- n > 1: one user request, n engine requests -----------------------------------------------
# ``n > 1``: one user request fans out into ``n`` child requests (vLLM's ParentRequest).
#
# Children are ordinary engine requests with the same prompt and ``n=1``. They are added
# together, so the scheduler admits them one after the other: the first child's full prompt
# blocks enter the prefix cache as soon as they are allocated and its siblings hit them, in the
# same step — the prompt's full blocks are prefilled once (each child recomputes at most its
# last, partial block, as with any prefix-cache hit).
#
# Seeds: with ``seed=s``, child ``i`` uses ``s + i`` (vLLM's rule), so the n samples are
# different yet the whole request is reproducible. Without a seed, children draw from the
# engine's generator. Prompt logprobs are computed by child 0 only: the others may then take
# prefix-cache hits (a request that wants prompt logprobs cannot).


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """A child's engine request id; with ``n == 1`` the request is its own only child."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    return dataclasses.replace(
        params, n=1,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class ParentRequest:
    """The user's request; ``n == 1`` is the trivial case of one child with the same id.

    Collects the children's completions into one ``RequestOutput`` (``outputs[i].index ==
    i``), following the output kind: FINAL_ONLY once all children finished; CUMULATIVE every
    child's latest completion; DELTA the completions that changed since the last output."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.n = params.n
        self.output_kind = output_kind
        self.child_ids = [child_request_id(request_id, i, self.n) for i in range(self.n)]
        self.child_params = [child_params(params, i) for i in range(self.n)] \
            if self.n > 1 else [params]
        self._latest: list[CompletionOutput | None] = [None] * self.n
        self._changed: dict[int, CompletionOutput] = {}
        self._finished: set[int] = set()
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_sent = False
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return len(self._finished) == self.n

    def record(self, index: int, completion: CompletionOutput | None, finished: bool) -> None:
        if completion is not None:
            self._latest[index] = completion
            self._changed[index] = completion
        if finished:
            self._finished.add(index)

    def make_output(self) -> RequestOutput | None:
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            outputs = [c for c in self._latest if c is not None]
        elif kind == RequestOutputKind.DELTA:
            if not self._changed and not self.finished:
                return None
            outputs = [self._changed[i] for i in sorted(self._changed)]
        else:
            outputs = [c for c in self._latest if c is not None]
        self._changed = {}
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            if self._prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self._prompt_logprobs_sent = True
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                             finished=self.finished, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=self.num_cached_tokens,
                             kv_transfer_params=self.kv_transfer_params)


# -- one engine request's outputs ------------------------------------------------------------
class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; llmkit needs "
                            "a `tokenizers`-backed one for incremental detokenization")
        self._backend = backend
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PRIME_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        return "".join([self.add_token(t) for t in token_ids])


class TokenTexts:
    """Each token's own text (``Logprob.decoded_token``), decoded once per token id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


@dataclass(slots=True)
class RequestState:
    """One engine request (child ``index`` of ``parent``) as the front end tracks it."""

    request_id: str
    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    holdback: int  # trailing characters not streamed yet (a stop string may start there)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_sent_chars: int = 0  # DELTA: text already streamed
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by engine (child) request id
        self.parents: dict[str, ParentRequest] = {}
        self._token_text = TokenTexts(tokenizer)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    ) -> list[tuple[str, SamplingParams]]:
        """Track a user request; return the engine requests to add for it: ``(request_id,
        params)`` per child (one, with the same id, when ``n == 1``)."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, output_kind)
        self.parents[request_id] = parent
        for i, (cid, cparams) in enumerate(zip(parent.child_ids, parent.child_params)):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           skip_special_tokens=cparams.skip_special_tokens)
            # Without stop strings nothing is held back (and their module is not asked).
            holdback = holdback_chars(cparams.stop, cparams.include_stop_str_in_output) \
                if cparams.stop else 0
            self.states[cid] = RequestState(
                cid, parent, i, cparams, detok, holdback,
                logprobs=[] if cparams.logprobs is not None else None,
                cumulative_logprob=0.0 if cparams.logprobs is not None else None)
        return list(zip(parent.child_ids, parent.child_params))

    def child_request_ids(self, request_id: str) -> list[str]:
        """The engine request ids of a user request that is still running."""
        parent = self.parents.get(request_id)
        if parent is None:
            return [request_id] if request_id in self.states else []
        return [c for c in parent.child_ids if c in self.states]

    # -- one step -------------------------------------------------------------------------
    def process(self, outputs: list[EngineCoreOutput],
                reqs_to_abort: list[str] | None = None
                ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """User-facing outputs for one step's engine outputs. Engine requests finished here
        by a stop string are appended to ``reqs_to_abort``: abort them in the core."""
        touched: dict[str, ParentRequest] = {}
        embeddings: list[EmbeddingRequestOutput] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # finished here already (a stop string), or unknown
            if out.pooling_output is not None:
                embeddings.append(self._embedding(state, out))
                continue
            new_ids, new_logprobs = self._update(state, out)
            parent = state.parent
            if out.num_cached_tokens and state.index == 0:
                parent.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            finished = state.finish_reason is not None
            if finished:
                del self.states[out.request_id]
                if out.finish_reason is None and reqs_to_abort is not None:
                    reqs_to_abort.append(out.request_id)  # the core still runs it
            parent.record(state.index, self._completion(state, new_ids, new_logprobs),
                          finished)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            ro = parent.make_output()
            if ro is not None:
                results.append(ro)
            if parent.finished:
                del self.parents[parent.request_id]
        return results + embeddings

    def _embedding(self, state: RequestState, out: EngineCoreOutput) -> EmbeddingRequestOutput:
        """A pooling request's one output (it has no text: its prompt's embedding)."""
        del self.states[out.request_id]
        parent = self.parents.pop(state.parent.request_id)
        return EmbeddingRequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                                      EmbeddingOutput(out.pooling_output),
                                      num_cached_tokens=out.num_cached_tokens)

    def _update(self, state: RequestState,
                out: EngineCoreOutput) -> tuple[list[int], list[dict[int, Logprob]]]:
        """Take in one step's tokens; return the tokens kept and their logprob dicts."""
        sp = state.params
        if out.new_prompt_logprobs is not None and state.parent.prompt_logprobs is None:
            state.parent.prompt_logprobs = [None] + self._logprob_dicts(out.new_prompt_logprobs)
        new_ids = out.new_token_ids
        lps = self._logprob_dicts(out.new_logprobs) if out.new_logprobs is not None else []
        # The core stopped on EOS or a stop token id: that token is not part of the text
        # unless asked (vLLM's rule; it is in token_ids either way).
        skip_last = out.finish_reason == "stop" and not sp.include_stop_str_in_output
        kept = len(new_ids)
        stop: tuple[str, int] | None = None
        for j, tok in enumerate(new_ids):
            state.token_ids.append(tok)
            if skip_last and j == len(new_ids) - 1:
                break
            piece = state.detokenizer.add_token(tok)
            state.text += piece
            # Stop strings count only once min_tokens outputs exist (as in vLLM).
            if sp.stop and piece and len(state.token_ids) > sp.min_tokens:
                stop = find_stop_string(state.text, len(piece), sp.stop,
                                        sp.include_stop_str_in_output)
                if stop is not None:
                    kept = j + 1
                    break
        del lps[kept:]
        if state.logprobs is not None and out.new_logprobs is not None:
            state.logprobs.extend(lps)
            state.cumulative_logprob += sum(row[0] for row in out.new_logprobs.logprobs[:kept])
        if stop is not None:
            state.text = state.text[:stop[1]]
            state.finish_reason, state.stop_reason = "stop", stop[0]
        elif out.finish_reason is not None:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        return new_ids[:kept], lps

    def _completion(self, state: RequestState, new_ids: list[int],
                    new_logprobs: list[dict[int, Logprob]]) -> CompletionOutput | None:
        finished = state.finish_reason is not None
        kind = state.parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = state.text if finished or not state.holdback \
            else state.text[:max(0, len(state.text) - state.holdback)]
        if kind == RequestOutputKind.DELTA:
            text = visible[state.num_sent_chars:]
            state.num_sent_chars = max(state.num_sent_chars, len(visible))
            ids, logprobs = list(new_ids), (new_logprobs if state.logprobs is not None
                                            else None)
        else:
            text, ids = visible, list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        return CompletionOutput(index=state.index, text=text, token_ids=ids,
                                cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
                                finish_reason=state.finish_reason,
                                stop_reason=state.stop_reason)

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """vLLM's layout: the chosen token with its rank, then the top-k with ranks 1..k (a
        chosen token among the top-k appears once)."""
        text = self._token_text
        out = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            d = {ids[0]: Logprob(lps[0], rank, text(ids[0]))}
            for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                d[t] = Logprob(lp, r, text(t))
            out.append(d)
        return out
