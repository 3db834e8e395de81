"""Turns the core's per-step token outputs into user-facing RequestOutputs (detokenized)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from llmkit.engine.detokenizer import IncrementalDetokenizer
from llmkit.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from llmkit.sampling.params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_kind: RequestOutputKind
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                               detok, output_kind)

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        results = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            delta_text = state.detokenizer.add_tokens(out.new_token_ids)
            state.token_ids.extend(out.new_token_ids)
            state.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                state.finish_reason = out.finish_reason
                state.stop_reason = out.stop_reason
                del self.states[out.request_id]
            ro = self._make_output(state, out.new_token_ids, delta_text)
            if ro is not None:
                results.append(ro)
        return results

    @staticmethod
    def _make_output(state: RequestState, new_ids: list[int],
                     delta_text: str) -> RequestOutput | None:
        finished = state.finish_reason is not None
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            text, ids = delta_text, list(new_ids)
        else:
            text, ids = state.detokenizer.text, list(state.token_ids)
        completion = CompletionOutput(index=0, text=text, token_ids=ids,
                                      finish_reason=state.finish_reason,
                                      stop_reason=state.stop_reason)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                             finished=finished, num_cached_tokens=state.num_cached_tokens)
