"""``n > 1``: one user request fans out into ``n`` child requests (vLLM's ParentRequest).

Children are ordinary engine requests with the same prompt and ``n=1``. They are added
together, so the scheduler admits them one after the other: the first child's full prompt
blocks enter the prefix cache as soon as they are allocated and its siblings hit them, in the
same step — the prompt's full blocks are prefilled once (each child recomputes at most its
last, partial block, as with any prefix-cache hit).

Seeds: with ``seed=s``, child ``i`` uses ``s + i`` (vLLM's rule), so the n samples are
different yet the whole request is reproducible. Without a seed, children draw from the
engine's generator. Prompt logprobs are computed by child 0 only: the others may then take
prefix-cache hits (a request that wants prompt logprobs cannot).
"""
from __future__ import annotations

import dataclasses

from llmkit.outputs import CompletionOutput, Logprob, RequestOutput
from llmkit.sampling.params import RequestOutputKind, SamplingParams


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
