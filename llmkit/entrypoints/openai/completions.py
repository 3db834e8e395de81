"""``/v1/completions``: one prompt or a list (text or token ids) → engine requests → choices,
sampled or, with vLLM's ``use_beam_search``, beam-searched. Both build their choices and usage
in one place (``completion_choices``).

Sampled: ``n > 1`` and a list of prompts both fan out into engine requests (``AsyncLLM``
handles ``n``: ``n`` engine requests with seeds ``seed + i``); choice ``index`` =
``prompt_index * n + i``. Usage counts the prompt tokens once per prompt and every generated
token of every choice.

Beam search: ``n`` is the beam width, each prompt's ``n`` best beams are its choices (best
first), scored with ``length_penalty`` (``llmkit.engine.beam_search``;
``AsyncLLM.beam_search`` runs them). Streamed, each choice is one chunk at the end (the beams
are known only then). Fields beam search would silently drop are a 400 naming the field rather
than ignored: structured output, stop conditions, penalties, the sampling filters and
disaggregated serving's hand-over. ``n`` is at most 10 (vLLM's limit: its ``2 * n``
candidates per beam stay within 20 logprobs), ``logprobs`` at most ``2 * n`` (the candidates
are all a beam sees).
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmkit.engine.async_llm import (AsyncLLM, EngineDeadError, EngineOverloadedError,
                                     RequestStream)
from llmkit.engine.beam_search import BeamSearchParams
from llmkit.entrypoints.openai.errors import (OpenAIError, bad_request, engine_dead, overloaded,
                                              param_of, refused)
from llmkit.entrypoints.openai.logprobs import completion_logprobs
from llmkit.entrypoints.openai.protocol import (CompletionChoice, CompletionRequest,
                                                CompletionResponse, Usage)
from llmkit.entrypoints.openai.sampling import requested_structured_outputs
from llmkit.entrypoints.openai.serving import OpenAIServing, set_cached_tokens, usage_so_far
from llmkit.entrypoints.openai.streaming import (EngineStreamingResponse, abort_all, collect,
                                                 merge, run_until_disconnect, sse)
from llmkit.lora.request import LoRARequest
from llmkit.outputs import RequestOutput

__all__ = ["MAX_BEAM_WIDTH", "check_beam_search_request", "completion_choices",
           "create_completion"]

MAX_BEAM_WIDTH = 10


async def create_completion(s: OpenAIServing, req: CompletionRequest, raw_request: Request):
    """The response to ``req``: a ``CompletionResponse``, server-sent events when ``stream``
    is true, or 499 when the client left first."""
    s._warn_extra(req)
    lora = s.check_model(req.model)
    s.check_engine()
    if req.echo:
        raise bad_request("`echo` is not supported by this server", "echo")
    if req.suffix is not None:
        raise bad_request("`suffix` is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (best_of > n is not supported)", "best_of")
    prompts, texts = _prompts(s, req)
    for ids in prompts:
        s._check_length(len(ids), req.max_tokens, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = s.response_model(lora)
    if req.use_beam_search:
        check_beam_search_request(req)
        beams = [_beam_params(s.engine, req, ids) for ids in prompts]  # a 400, not an event

        def search() -> Awaitable[list[RequestOutput]]:
            return _search_all(s.engine, req, request_id, prompts, beams, lora)

        if req.stream:
            # closing the stream cancels the search, which aborts its beams' requests
            return EngineStreamingResponse(
                _beam_events(s, req, request_id, created, model, search), on_close=lambda: None)
        results = await run_until_disconnect(raw_request, search(), lambda: None)
    else:
        params = s.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                   structured_outputs=s.structured_outputs(req),
                                   num_prompts=len(prompts))
        streams = await s._start(request_id, prompts, texts, params, req.n, req.priority,
                                 req.stream, req.cache_salt, lora)
        if req.stream:
            return EngineStreamingResponse(
                _events(s, req, request_id, created, streams, prompts, model),
                on_close=lambda: abort_all(streams))
        results = await run_until_disconnect(raw_request, collect(streams),
                                             lambda: abort_all(streams))
    if isinstance(results, Response):
        return results
    choices, usage = completion_choices(s, req, results)
    if not req.use_beam_search:  # a beam's prefix hits are its step requests', not reported
        set_cached_tokens(usage, sum(ro.num_cached_tokens for ro in results))
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage, kv_transfer_params=results[0].kv_transfer_params)


def _prompts(s: OpenAIServing, req: CompletionRequest
             ) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids and text (None: given as ids)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif isinstance(prompt[0], int):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    ids_list, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = s.encode(item, "prompt")
            if not ids:
                raise bad_request("the prompt is empty (no tokens)", "prompt")
            ids_list.append(ids)
            texts.append(item)
        else:
            s._check_ids(item, "prompt")
            ids_list.append(list(item))
            texts.append(None)
    return ids_list, texts


def completion_choices(s: OpenAIServing, req: CompletionRequest, results: list[RequestOutput]
                       ) -> tuple[list[CompletionChoice], Usage]:
    """Each prompt's final output (sampled, or its best beams) as choices ``prompt_index * n
    + i``, in that order, and their usage."""
    choices, usage = [], Usage()
    for p, ro in enumerate(results):
        usage.prompt_tokens += len(ro.prompt_token_ids)
        for c in ro.outputs:
            usage.completion_tokens += len(c.token_ids)
            choices.append(CompletionChoice(
                index=p * req.n + c.index, text=c.text,
                logprobs=completion_logprobs(s.tokenizer, c, req.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    choices.sort(key=lambda ch: ch.index)
    return choices, usage


async def _events(s: OpenAIServing, req: CompletionRequest, request_id: str, created: int,
                  streams: list[RequestStream], prompts: list[list[int]],
                  model: str) -> AsyncIterator[str]:
    usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
    offsets: dict[int, int] = {}
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    cached: dict[int, int] = {}
    try:
        async for p, ro in merge(streams):
            cached[p] = ro.num_cached_tokens
            for c in ro.outputs:
                index = p * req.n + c.index
                usage.completion_tokens += len(c.token_ids)
                if not c.text and c.finish_reason is None and c.logprobs is None:
                    continue
                lp = completion_logprobs(s.tokenizer, c, req.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.text)
                choice = {"index": index, "text": c.text,
                          "logprobs": lp.model_dump() if lp else None,
                          "finish_reason": c.finish_reason}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield sse({**base, "choices": [choice],
                           **usage_so_far(usage, req.continuous_usage)})
        if req.include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            set_cached_tokens(usage, sum(cached.values()))
            yield sse({**base, "choices": [], "usage": usage.model_dump(exclude_none=True)})
    except EngineDeadError as e:
        yield sse(engine_dead(e).body())
    except ValueError as e:  # the engine refused the request
        yield sse(refused(e).body())
    yield sse("[DONE]")


# --------------------------------------------------------------------------- beam search

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


def _beam_params(engine: AsyncLLM, req: CompletionRequest,
                 prompt: list[int]) -> BeamSearchParams:
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


async def _beam_events(s: OpenAIServing, req: CompletionRequest, request_id: str, created: int,
                       model: str, search: Callable[[], Awaitable[list[RequestOutput]]]
                       ) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    try:
        choices, usage = completion_choices(s, req, await search())
        for c in choices:
            yield sse({**base, "choices": [c.model_dump()]})
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": usage.model_dump(exclude_none=True)})
    except OpenAIError as e:
        yield sse(e.body())
    yield sse("[DONE]")
