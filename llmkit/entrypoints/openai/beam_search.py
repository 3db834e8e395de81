"""``/v1/completions`` with vLLM's ``use_beam_search``: ``n`` is the beam width, each prompt's
``n`` best beams are its choices (best first), scored with ``length_penalty``
(``llmkit.engine.beam_search``; ``AsyncLLM.beam_search`` runs them).

Streamed, each choice is one chunk at the end (the beams are known only then). Fields beam
search would silently drop are a 400 naming the field rather than ignored: structured output,
stop conditions, penalties, the sampling filters and disaggregated serving's hand-over. ``n``
is at most 10 (vLLM's limit: its ``2 * n`` candidates per beam stay within 20 logprobs),
``logprobs`` at most ``2 * n`` (the candidates are all a beam sees).
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmkit.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from llmkit.engine.beam_search import BeamSearchParams
from llmkit.entrypoints.openai.errors import (OpenAIError, bad_request, engine_dead, overloaded,
                                              param_of)
from llmkit.entrypoints.openai.logprobs import completion_logprobs
from llmkit.entrypoints.openai.protocol import (CompletionChoice, CompletionRequest,
                                                CompletionResponse, Usage)
from llmkit.entrypoints.openai.streaming import (EngineStreamingResponse, run_until_disconnect,
                                                 sse)
from llmkit.entrypoints.openai.sampling import requested_structured_outputs
from llmkit.lora.request import LoRARequest
from llmkit.outputs import RequestOutput

__all__ = ["MAX_BEAM_WIDTH", "beam_search_completion", "check_beam_search_request"]

MAX_BEAM_WIDTH = 10

# field -> its value when unset or neutral (anything else would be silently ignored)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "stop": (None, [], ""), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "min_tokens": (0,),
    "kv_transfer_params": (None,),
}


def check_beam_search_request(req: CompletionRequest) -> None:
    """A 400 naming the first field that beam search cannot honour."""
    if req.n > MAX_BEAM_WIDTH:
        raise bad_request(f"with use_beam_search, n is the beam width: at most "
                          f"{MAX_BEAM_WIDTH}, got {req.n}", "n")
    if req.logprobs is not None and req.logprobs > 2 * req.n:
        raise bad_request(f"with use_beam_search, logprobs must be at most 2 * n "
                          f"({2 * req.n}), got {req.logprobs}", "logprobs")
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name) not in neutral:
            raise bad_request(f"{name} cannot be used with use_beam_search", name)
    _, field = requested_structured_outputs(req)
    if field is not None:
        raise bad_request(f"{field} (structured output) cannot be used with use_beam_search",
                          field)


def _bad_input(e: ValueError) -> Exception:
    m = re.match(r"BeamSearchParams\.([a-z_]+):", str(e))
    return bad_request(str(e), m.group(1) if m else (param_of(str(e)) or "prompt"))


def _params(engine: AsyncLLM, req: CompletionRequest, prompt: list[int]) -> BeamSearchParams:
    max_tokens = req.max_tokens if req.max_tokens is not None \
        else engine.max_model_len - len(prompt)
    try:
        return BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
            # unset: 0, not the model's default, so that a search is repeatable
            temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        raise _bad_input(e) from None


async def _search_all(engine: AsyncLLM, req: CompletionRequest, request_id: str,
                      prompts: list[list[int]], params: list[BeamSearchParams],
                      lora: LoRARequest | None) -> list[RequestOutput]:
    async def one(p: int) -> RequestOutput:
        async for out in engine.beam_search(prompts[p], f"{request_id}-{p}", params[p],
                                            priority=req.priority, cache_salt=req.cache_salt,
                                            lora_request=lora):
            return out
        raise AssertionError("beam search yielded nothing")

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(p)) for p in range(len(prompts))]
    except ExceptionGroup as eg:
        e = eg.exceptions[0]
        if isinstance(e, EngineOverloadedError):
            raise overloaded(e) from None
        if isinstance(e, EngineDeadError):
            raise engine_dead(e) from None
        if isinstance(e, (ValueError, OverflowError)):
            raise _bad_input(e) from None
        raise e from None
    return [t.result() for t in tasks]


def _choices(engine: AsyncLLM, req: CompletionRequest, results: list[RequestOutput]
             ) -> tuple[list[CompletionChoice], Usage]:
    choices, usage = [], Usage()
    for p, ro in enumerate(results):
        usage.prompt_tokens += len(ro.prompt_token_ids)
        for c in ro.outputs:
            usage.completion_tokens += len(c.token_ids)
            choices.append(CompletionChoice(
                index=p * req.n + c.index, text=c.text,
                logprobs=completion_logprobs(engine.tokenizer, c, req.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return choices, usage


async def beam_search_completion(engine: AsyncLLM, req: CompletionRequest,
                                 raw_request: Request, prompts: list[list[int]], model: str,
                                 lora: LoRARequest | None
                                 ) -> CompletionResponse | StreamingResponse | Response:
    """The completion response of ``req`` (``use_beam_search``), its prompts tokenized and
    their lengths checked by the caller. Streamed, as vLLM's: the beams are known only at the
    end, so each choice is one chunk then."""
    check_beam_search_request(req)
    params = [_params(engine, req, ids) for ids in prompts]  # bad input: a 400, not an event
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    def search() -> Awaitable[list[RequestOutput]]:
        return _search_all(engine, req, request_id, prompts, params, lora)

    if req.stream:
        # closing the stream cancels the search, which aborts its beams' requests
        return EngineStreamingResponse(_events(engine, req, request_id, created, model, search),
                                       on_close=lambda: None)
    results = await run_until_disconnect(raw_request, search(), lambda: None)
    if isinstance(results, Response):
        return results
    choices, usage = _choices(engine, req, results)
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage)


async def _events(engine: AsyncLLM, req: CompletionRequest, request_id: str, created: int,
                  model: str, search: Callable[[], Awaitable[list[RequestOutput]]]
                  ) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    try:
        choices, usage = _choices(engine, req, await search())
        for c in choices:
            yield sse({**base, "choices": [c.model_dump()]})
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": usage.model_dump(exclude_none=True)})
    except OpenAIError as e:
        yield sse(e.body())
    yield sse("[DONE]")
