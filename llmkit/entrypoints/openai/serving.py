"""The OpenAI endpoints' logic: request → ``SamplingParams`` → ``AsyncLLM`` streams → OpenAI
response bodies (JSON, or server-sent events when ``stream`` is true).

Sampling fields pass to ``SamplingParams`` by their (vLLM = OpenAI) names. A field set to a
non-neutral value that this build's ``SamplingParams`` lacks is refused with a 400 naming it,
never silently ignored.

``n > 1`` and a list of prompts both fan out into engine requests (``AsyncLLM`` handles ``n``:
``n`` engine requests with seeds ``seed + i``); choice ``index`` = ``prompt_index * n + i``.
Usage counts the prompt tokens once per prompt and every generated token of every choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmkit.engine.async_llm import (AsyncLLM, EngineDeadError, EngineOverloadedError,
                                     RequestOutputKind, RequestStream)
from llmkit.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse,
                                                ChatLogprobs, ChatLogprobToken, ChatLogprobTop,
                                                ChatResponseMessage, ChatStreamChoice,
                                                CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse,
                                                DeltaMessage, DetokenizeRequest,
                                                DetokenizeResponse, ErrorInfo, ErrorResponse,
                                                ModelCard, ModelList, PromptTokensDetails,
                                                SamplingFields, TokenizeRequest,
                                                TokenizeResponse, Usage)
from llmkit.outputs import RequestOutput
from llmkit.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Values that ask for nothing: a field that SamplingParams lacks may still be sent with these.
_NEUTRAL: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "repetition_penalty": 1.0, "include_stop_str_in_output": False,
                            "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
                            "spaces_between_special_tokens": True}


class OpenAIError(Exception):
    """An error answered with OpenAI's body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def engine_dead(err: BaseException | None = None) -> OpenAIError:
    return OpenAIError(500, f"the engine is not running: {err}" if err else
                       "the engine is not running", type="server_error", code="engine_dead")


def overloaded(err: EngineOverloadedError) -> OpenAIError:
    return OpenAIError(503, str(err), type="service_unavailable_error", code="overloaded",
                       headers={"Retry-After": str(err.retry_after)})


def _param_of(message: str) -> str | None:
    m = re.match(r"(?:SamplingParams\.)?([a-z_]+):", message)
    return m.group(1) if m else None


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """A server-sent-event stream that calls ``on_close`` however it ends: finished, client
    gone (noticed at once, even while no token flows), or cancelled at shutdown."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        body = asyncio.ensure_future(self.stream_response(send))

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, watcher):
                if not task.done():
                    task.cancel()
            self._on_close()
            await asyncio.gather(body, watcher, return_exceptions=True)
        if body.done() and not body.cancelled() and body.exception() is not None \
                and not isinstance(body.exception(), OSError):
            raise body.exception()


async def run_until_disconnect(raw_request: Request, work, on_disconnect: Callable[[], None]):
    """Await ``work``; if the client disconnects first, cancel it and call ``on_disconnect``."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        on_disconnect()
        return Response(status_code=499)
    return task.result()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.model_name = served_model_names[0]
        cfg = engine.model_source.hf_config
        self.vocab_size = int(getattr(cfg, "vocab_size", None) or len(self.tokenizer))
        self._warned_fields: set[str] = set()

    # -- shared checks ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist. This server serves "
                                   f"`{self.model_name}`.", param="model",
                              code="model_not_found")

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise engine_dead(self.engine.dead_error)

    def _warn_extra(self, req: Any) -> None:
        extra = set(req.model_extra or ()) - self._warned_fields
        if extra:
            self._warned_fields |= extra
            logger.warning("ignored unknown request fields: %s", ", ".join(sorted(extra)))

    def _check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if t >= self.vocab_size:
                raise bad_request(f"token id {t} is out of range (the vocabulary has "
                                  f"{self.vocab_size} tokens)", param)

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        stop = req.stop
        wanted: dict[str, Any] = {
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p, "seed": req.seed, "max_tokens": max_tokens,
            "min_tokens": req.min_tokens, "stop": [stop] if isinstance(stop, str) else stop,
            "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "logit_bias": ({int(k): v for k, v in req.logit_bias.items()}
                           if req.logit_bias else None),
            "logprobs": logprobs, "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "bad_words": req.bad_words, "allowed_token_ids": req.allowed_token_ids,
        }
        for name, ids in (("logit_bias", list(wanted["logit_bias"] or ())),
                          ("stop_token_ids", req.stop_token_ids or []),
                          ("allowed_token_ids", req.allowed_token_ids or [])):
            self._check_ids(ids, name)
        kwargs: dict[str, Any] = {}
        for name, value in wanted.items():
            neutral = value is None or value == [] or (name in _NEUTRAL
                                                       and value == _NEUTRAL[name])
            if name not in _PARAM_FIELDS:
                if not neutral:
                    raise bad_request(f"`{name}` is not supported by this server yet", name)
                continue
            if value is not None or name == "max_tokens":
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), _param_of(str(e))) from None

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None,
                      prompt_param: str) -> None:
        limit = self.engine.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt has {num_prompt_tokens} tokens, which leaves no room for the "
                    "completion. Please shorten the prompt.", prompt_param)
        elif num_prompt_tokens + max_tokens > limit:
            param = prompt_param if num_prompt_tokens >= limit else "max_tokens"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} in the completion). Please reduce the prompt or "
                "the completion length.", param)

    async def _start(self, request_id: str, prompts: list[list[int]],
                     prompt_texts: list[str | None], params: SamplingParams, n: int,
                     priority: int, stream: bool,
                     cache_salt: str | None = None) -> list[RequestStream]:
        """Admit one engine request (of ``n`` samples) per prompt; all or none."""
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        streams: list[RequestStream] = []
        try:
            for p, (ids, text) in enumerate(zip(prompts, prompt_texts)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{p}"
                streams.append(await self.engine.add_request(
                    rid, ids, params, n=n, priority=priority, output_kind=kind,
                    prompt_text=text, cache_salt=cache_salt))
        except EngineOverloadedError as e:
            _abort_all(streams)
            raise overloaded(e) from None
        except EngineDeadError as e:
            _abort_all(streams)
            raise engine_dead(e) from None
        except ValueError as e:
            _abort_all(streams)
            raise bad_request(str(e), _param_of(str(e))) from None
        return streams

    # -- /v1/models -------------------------------------------------------------------------
    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name,
                                         root=str(self.engine.model_source.path),
                                         max_model_len=self.engine.max_model_len)])

    # -- /v1/completions --------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]],
                                                                    list[str | None]]:
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
                ids = self.tokenizer.encode(item)
                if not ids:
                    raise bad_request("the prompt is empty (no tokens)", "prompt")
                ids_list.append(ids)
                texts.append(item)
            else:
                self._check_ids(item, "prompt")
                ids_list.append(list(item))
                texts.append(None)
        return ids_list, texts

    async def create_completion(self, req: CompletionRequest, raw_request: Request):
        self._warn_extra(req)
        self.check_model(req.model)
        self.check_engine()
        if req.echo:
            raise bad_request("`echo` is not supported by this server", "echo")
        if req.suffix is not None:
            raise bad_request("`suffix` is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best_of > n is not supported)", "best_of")
        prompts, texts = self._completion_prompts(req)
        for ids in prompts:
            self._check_length(len(ids), req.max_tokens, "prompt")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self._start(request_id, prompts, texts, params, req.n, req.priority,
                                    req.stream, req.cache_salt)
        if req.stream:
            return EngineStreamingResponse(
                self._completion_events(req, request_id, created, streams, prompts),
                on_close=lambda: _abort_all(streams))
        results = await run_until_disconnect(raw_request, _collect(streams),
                                             lambda: _abort_all(streams))
        if isinstance(results, Response):
            return results
        choices = []
        usage = Usage()
        for p, ro in enumerate(results):
            usage.prompt_tokens += len(ro.prompt_token_ids)
            _add_cached(usage, ro)
            for c in ro.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(
                    index=p * req.n + c.index, text=c.text,
                    logprobs=self._completion_logprobs(c, req.logprobs),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=request_id, created=created, model=self.model_name,
                                  choices=choices, usage=usage)

    async def _completion_events(self, req: CompletionRequest, request_id: str, created: int,
                                 streams: list[RequestStream],
                                 prompts: list[list[int]]) -> AsyncIterator[str]:
        usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        offsets: dict[int, int] = {}
        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}
        cached: dict[int, int] = {}
        try:
            async for p, ro in _merge(streams):
                cached[p] = ro.num_cached_tokens
                for c in ro.outputs:
                    index = p * req.n + c.index
                    usage.completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and c.logprobs is None:
                        continue
                    lp = self._completion_logprobs(c, req.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(c.text)
                    choice = {"index": index, "text": c.text,
                              "logprobs": lp.model_dump() if lp else None,
                              "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield _sse({**base, "choices": [choice]})
            if req.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                _set_cached(usage, sum(cached.values()))
                yield _sse({**base, "choices": [], "usage": usage.model_dump(exclude_none=True)})
        except EngineDeadError as e:
            yield _sse(engine_dead(e).body())
        except ValueError as e:  # the engine refused the request
            yield _sse(bad_request(str(e)).body())
        yield _sse("[DONE]")

    def _token_text(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id])

    def _logprob_rows(self, c, k: int | None):
        """(token_id, logprob, [(top_id, top_logprob, text)...]) for the new tokens of ``c``."""
        if k is None or c.logprobs is None:
            return None
        ids = list(c.token_ids)
        lps = list(c.logprobs)
        if len(lps) > len(ids):
            lps = lps[len(lps) - len(ids):]
        rows = []
        for tok, entry in zip(ids[len(ids) - len(lps):], lps):
            chosen = entry.get(tok)
            # The entry holds the top k (ranks 1..k) and the chosen token (any rank): the k
            # best by rank are OpenAI's top_logprobs, with the chosen one only if among them.
            tops = sorted(entry.items(), key=lambda x: (
                x[1].rank if x[1].rank is not None else 1 << 30, -x[1].logprob))[:k]
            top = [(t, lp.logprob, self._token_text(t, lp.decoded_token)) for t, lp in tops]
            rows.append((tok, chosen.logprob if chosen else float("nan"),
                         self._token_text(tok, chosen.decoded_token if chosen else None), top))
        return rows

    def _completion_logprobs(self, c, k: int | None, offset: int = 0) -> CompletionLogprobs | None:
        rows = self._logprob_rows(c, k)
        if rows is None:
            return None
        out = CompletionLogprobs()
        for _tok, lp, text, top in rows:
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({t: v for _, v, t in top} if k else None)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    # -- /v1/chat/completions ---------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions",
                              "messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name
                                                              else {})}
                    for m in req.messages or []]
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        continue_final = getattr(req, "continue_final_message", False)
        add_gen = req.add_generation_prompt and not continue_final
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_gen,
                **({"continue_final_message": True} if continue_final else {}), **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise bad_request(f"the chat template failed on these messages: {e}",
                              "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the conversation is empty (no tokens)", "messages")
        return ids

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request):
        self._warn_extra(req)
        self.check_model(req.model)
        self.check_engine()
        if req.tools:
            raise bad_request("`tools` are not supported by this server", "tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported",
                              "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        ids = self.chat_prompt(req)
        max_tokens = req.max_output_tokens
        self._check_length(len(ids), max_tokens, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=k)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self._start(request_id, [ids], [None], params, req.n, req.priority,
                                    req.stream, req.cache_salt)
        if req.stream:
            return EngineStreamingResponse(
                self._chat_events(req, request_id, created, streams, len(ids), k),
                on_close=lambda: _abort_all(streams))
        results = await run_until_disconnect(raw_request, _collect(streams),
                                             lambda: _abort_all(streams))
        if isinstance(results, Response):
            return results
        ro = results[0]
        usage = Usage(prompt_tokens=len(ro.prompt_token_ids))
        _add_cached(usage, ro)
        choices = []
        for c in ro.outputs:
            usage.completion_tokens += len(c.token_ids)
            choices.append(ChatChoice(index=c.index,
                                      message=ChatResponseMessage(content=c.text),
                                      logprobs=self._chat_logprobs(c, k),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                      choices=choices, usage=usage)

    def _chat_logprobs(self, c, k: int | None) -> ChatLogprobs | None:
        rows = self._logprob_rows(c, k)
        if rows is None:
            return None
        return ChatLogprobs(content=[
            ChatLogprobToken(token=text, logprob=lp, bytes=list(text.encode()),
                             top_logprobs=[ChatLogprobTop(token=t, logprob=v,
                                                          bytes=list(t.encode()))
                                           for _, v, t in top])
            for _tok, lp, text, top in rows])

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str, created: int,
                           streams: list[RequestStream], num_prompt_tokens: int,
                           k: int | None) -> AsyncIterator[str]:
        base = dict(id=request_id, created=created, model=self.model_name)
        usage = Usage(prompt_tokens=num_prompt_tokens)
        cached = 0
        try:
            for i in range(req.n):
                yield _sse(ChatCompletionChunk(**base, choices=[ChatStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""))]
                ).model_dump(exclude_none=True))
            async for _p, ro in _merge(streams):
                cached = ro.num_cached_tokens
                for c in ro.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and c.logprobs is None:
                        continue
                    lp = self._chat_logprobs(c, k)
                    choice = {"index": c.index,
                              "delta": {"content": c.text} if c.text else {},
                              "logprobs": lp.model_dump() if lp else None,
                              "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield _sse({**base, "object": "chat.completion.chunk",
                                "choices": [choice]})
            if req.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                _set_cached(usage, cached)
                yield _sse({**base, "object": "chat.completion.chunk", "choices": [],
                            "usage": usage.model_dump(exclude_none=True)})
        except EngineDeadError as e:
            yield _sse(engine_dead(e).body())
        except ValueError as e:  # the engine refused the request
            yield _sse(bad_request(str(e)).body())
        yield _sse("[DONE]")

    # -- /tokenize, /detokenize -------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.messages is not None:
            ids = self.chat_prompt(req)
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        if any(t < 0 for t in req.tokens):
            raise bad_request("token ids must be >= 0", "tokens")
        self._check_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


# --------------------------------------------------------------------------- helpers

def _abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (FINAL_ONLY streams yield exactly one)."""
    async def last(s: RequestStream) -> RequestOutput:
        final = None
        async for out in s:
            final = out
        assert final is not None
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    finally:
        _abort_all(streams)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _add_cached(usage: Usage, ro: RequestOutput) -> None:
    _set_cached(usage, (usage.prompt_tokens_details.cached_tokens
                        if usage.prompt_tokens_details else 0) + ro.num_cached_tokens)


def _set_cached(usage: Usage, cached: int) -> None:
    usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
