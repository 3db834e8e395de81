"""``OpenAIServing``: what the OpenAI endpoints share, and ``/v1/chat/completions``,
``/tokenize``, ``/detokenize``. A request → ``SamplingParams`` → ``AsyncLLM`` streams → OpenAI
response bodies (JSON, or server-sent events when ``stream`` is true).

Shared: the model a request names (``serving_models``), the engine's state, its sampling
fields and output constraint (``sampling``), its length against ``max_model_len``, its engine
requests admitted all or none, and a chat request's prompt (``chat_prompt``: messages, tools
and images). The endpoints that build on it: ``/v1/completions`` (``completions``, sampled or
beam search), ``/v1/responses`` (``responses``), ``/v1/embeddings`` (``embeddings``). Beside
them: ``errors`` (OpenAI error bodies), ``logprobs`` (their two OpenAI shapes) and
``streaming`` (a request's engine streams as a group, server-sent events, client
disconnects).

``n > 1`` fans out into engine requests (``AsyncLLM`` handles ``n``: ``n`` engine requests
with seeds ``seed + i``), each one a choice with its ``index``. Usage counts the prompt tokens
once and every generated token of every choice.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from llmkit.config.schema import LoRAConfig
from llmkit.engine.async_llm import AsyncLLM, EngineDeadError, RequestOutputKind, RequestStream
from llmkit.entrypoints.openai.chat_prompt import (ToolUse, load_chat_images, render_chat_prompt,
                                                   template_supports_tools, tool_use)
from llmkit.entrypoints.openai.errors import bad_request, engine_dead, refused
from llmkit.entrypoints.openai.logprobs import chat_logprobs
from llmkit.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse,
                                                ChatResponseMessage, ChatStreamChoice,
                                                DeltaMessage, DetokenizeRequest,
                                                DetokenizeResponse, FunctionCall, ModelList,
                                                PromptTokensDetails, SamplingFields,
                                                TokenizeRequest, TokenizeResponse, ToolCall,
                                                Usage)
from llmkit.entrypoints.openai.reasoning.request import RequestReasoning, make_reasoning_parser
from llmkit.entrypoints.openai.serving_models import ServingModels
from llmkit.entrypoints.openai.sampling import (check_token_ids, checked_structured_outputs,
                                                requested_structured_outputs, to_sampling_params)
from llmkit.entrypoints.openai.streaming import (EngineStreamingResponse, abort_all, admitting,
                                                 collect, merge, run_until_disconnect, sse)
from llmkit.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser
from llmkit.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer, new_tool_call_id
from llmkit.lora.request import LoRARequest
from llmkit.sampling.params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatPrompt:
    """A chat request made the engine's prompt (chat completions and the Responses API):
    ``request`` with its images loaded, its tool use, its output constraint (after the
    thinking, with a reasoning parser), ``prompt`` (token ids, or with the images) and how many
    tokens the engine sees in it."""

    request: ChatCompletionRequest
    use: ToolUse
    structured: StructuredOutputsParams | None
    thinking: RequestReasoning | None
    prompt: list[int] | dict
    num_prompt_tokens: int


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 lora: LoRAConfig | None = None) -> None:
        self.engine = engine
        self.frontend = engine.frontend  # the engine's: same template, images, defaults
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.model_name = served_model_names[0]
        self.models = ServingModels(engine, served_model_names, lora or LoRAConfig())
        # the engine's own (AsyncLLM's input processor checks against the same)
        self.vocab_size = engine.model_facts.vocab_size
        self._warned_fields: set[str] = set()
        template = self.tokenizer.chat_template
        self.template_has_tools = template_supports_tools(template)
        parser_name = engine.config.server.tool_call_parser
        if parser_name == "auto":
            parser_name = default_tool_parser(template)
        self.tool_parser = TOOL_PARSERS.get(parser_name)()
        self.reasoning_parser = make_reasoning_parser(engine.config.server.reasoning_parser,
                                                      self.tokenizer)

    # -- shared checks ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's ``model`` names (None: the base model); a 404
        ``OpenAIError`` for a name this server does not serve."""
        return self.models.resolve(name)

    def response_model(self, lora: LoRARequest | None) -> str:
        return lora.lora_name if lora is not None else self.model_name

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise engine_dead(self.engine.dead_error)

    def _warn_extra(self, req: Any) -> None:
        extra = set(req.model_extra or ()) - self._warned_fields
        if extra:
            self._warned_fields |= extra
            logger.warning("ignored unknown request fields: %s", ", ".join(sorted(extra)))

    def encode(self, text: str, param: str, **kwargs) -> list[int]:
        """Token ids of ``text``; a 400 naming ``param`` for text the tokenizer cannot take
        (JSON allows lone UTF-16 surrogates, which are not Unicode text)."""
        try:
            return self.tokenizer.encode(text, **kwargs)
        except (TypeError, ValueError, UnicodeError) as e:
            raise bad_request(f"the text cannot be tokenized (is it valid Unicode, without "
                              f"lone surrogates?): {e}", param) from None

    def _check_ids(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, param, self.vocab_size)

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                        logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        num_prompts: int = 1) -> SamplingParams:
        """The request's ``SamplingParams`` (a 400 ``OpenAIError`` for what cannot be met)."""
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                    vocab_size=self.vocab_size,
                                    defaults=self.frontend.default_sampling_fields,
                                    structured_outputs=structured_outputs)
        if req.kv_transfer_params is not None:
            if req.n != 1 or num_prompts != 1:
                raise bad_request("kv_transfer_params needs one prompt and n=1",
                                  "kv_transfer_params")
            if self.engine.config.kv_transfer.name == "none":
                raise bad_request("kv_transfer_params needs a KV connector; this server runs "
                                  "with kv_transfer=none", "kv_transfer_params")
            params.extra_args = {**(params.extra_args or {}),
                                 "kv_transfer_params": dict(req.kv_transfer_params)}
        return params

    def structured_outputs(self, req: SamplingFields,
                           forced: tuple[StructuredOutputsParams, str] | None = None
                           ) -> StructuredOutputsParams | None:
        """The request's output constraint, checked by the engine's grammar backend (a 400
        naming the field for a bad or unsupported spec). ``forced``: the constraint tool
        calls need, and the field it comes from."""
        params, field = requested_structured_outputs(req)
        if forced is not None:
            if params is not None:
                raise bad_request(f"`{field}` cannot be combined with a tool_choice that "
                                  "forces tool calls", field)
            params, field = forced
        if params is None:
            return None
        return checked_structured_outputs(self.engine.config, params, field)

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
                     priority: int, stream: bool, cache_salt: str | None = None,
                     lora: LoRARequest | None = None) -> list[RequestStream]:
        """Admit one engine request (of ``n`` samples) per prompt; all or none."""
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        streams: list[RequestStream] = []
        with admitting(streams):
            for p, (ids, text) in enumerate(zip(prompts, prompt_texts)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{p}"
                streams.append(await self.engine.add_request(
                    rid, ids, params, n=n, priority=priority, output_kind=kind,
                    prompt_text=text, cache_salt=cache_salt, lora_request=lora))
        return streams

    # -- /v1/models -------------------------------------------------------------------------
    def list_models(self) -> ModelList:
        return self.models.list_models()

    # -- /v1/chat/completions ---------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request):
        self._warn_extra(req)
        if (req.model_extra or {}).get("use_beam_search"):
            raise bad_request("use_beam_search is supported on /v1/completions only",
                              "use_beam_search")
        lora = self.check_model(req.model)
        self.check_engine()
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        chat = await self.chat_prompt(req)
        req, use, thinking = chat.request, chat.use, chat.thinking
        num_prompt_tokens = chat.num_prompt_tokens
        max_tokens = req.max_output_tokens
        self._check_length(num_prompt_tokens, max_tokens, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=k,
                                      structured_outputs=chat.structured)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self._start(request_id, [chat.prompt], [None], params, req.n,
                                    req.priority, req.stream, req.cache_salt, lora)
        model = self.response_model(lora)
        if req.stream:
            return EngineStreamingResponse(
                self._chat_events(req, request_id, created, streams, num_prompt_tokens, k, use,
                                  model, thinking),
                on_close=lambda: abort_all(streams))
        results = await run_until_disconnect(raw_request, collect(streams),
                                             lambda: abort_all(streams))
        if isinstance(results, Response):
            return results
        ro = results[0]
        usage = Usage(prompt_tokens=len(ro.prompt_token_ids))
        set_cached_tokens(usage, ro.num_cached_tokens)
        choices = []
        for c in ro.outputs:
            usage.completion_tokens += len(c.token_ids)
            message, finish_reason = _chat_message(c.text, c.finish_reason, use, thinking)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=(chat_logprobs(self.tokenizer, c, k)
                                                if k is not None else None),
                                      finish_reason=finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return ChatCompletionResponse(id=request_id, created=created, model=model,
                                      choices=choices, usage=usage,
                                      kv_transfer_params=ro.kv_transfer_params)

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str, created: int,
                           streams: list[RequestStream], num_prompt_tokens: int,
                           k: int | None, use: ToolUse, model: str,
                           thinking: RequestReasoning | None = None) -> AsyncIterator[str]:
        base = dict(id=request_id, created=created, model=model)
        usage = Usage(prompt_tokens=num_prompt_tokens)
        cached = 0
        # Per choice: tool calls found as the text grows, sent as OpenAI deltas.
        streamers = {i: ToolCallStreamer(use.parser) for i in range(req.n)} \
            if use.parser is not None else {}
        # Per choice: the thinking split off first (tool calls are in the answer).
        thinkers = {i: thinking.streamer() for i in range(req.n)} if thinking else {}
        try:
            for i in range(req.n):
                yield sse(ChatCompletionChunk(**base, choices=[ChatStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""))]
                ).model_dump(exclude_none=True))
            async for _p, ro in merge(streams):
                cached = ro.num_cached_tokens
                for c in ro.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    finish_reason = c.finish_reason
                    text, reasoning = c.text, ""
                    if (thinker := thinkers.get(c.index)) is not None:
                        reasoning, text = thinker.feed(c.text)
                        if finish_reason is not None:
                            more_reasoning, more_text = thinker.finish()
                            reasoning, text = reasoning + more_reasoning, text + more_text
                    streamer = streamers.get(c.index)
                    if streamer is not None:
                        delta = streamer.feed(text, finish_reason is not None)
                        if streamer.tools_called and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    else:
                        delta = {"content": text} if text else {}
                    if reasoning:
                        delta = {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
                    if not delta and finish_reason is None and c.logprobs is None:
                        continue
                    lp = chat_logprobs(self.tokenizer, c, k) if k is not None else None
                    choice = {"index": c.index, "delta": delta,
                              "logprobs": lp.model_dump() if lp else None,
                              "finish_reason": finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield sse({**base, "object": "chat.completion.chunk",
                                "choices": [choice],
                                **usage_so_far(usage, req.continuous_usage)})
            if req.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                set_cached_tokens(usage, cached)
                yield sse({**base, "object": "chat.completion.chunk", "choices": [],
                            "usage": usage.model_dump(exclude_none=True)})
        except EngineDeadError as e:
            yield sse(engine_dead(e).body())
        except ValueError as e:  # the engine refused the request
            yield sse(refused(e).body())
        yield sse("[DONE]")

    async def chat_prompt(self, req: ChatCompletionRequest) -> ChatPrompt:
        """Tools, output constraint, images, template and thinking of a chat request, as the
        engine takes them (400s naming the field they come from)."""
        use = tool_use(req, self.tool_parser, any_whitespace=not self.engine.config
                       .structured_output.disable_any_whitespace)
        forced = (use.structured_outputs, "tools") if use.structured_outputs else None
        structured = self.structured_outputs(req, forced)
        req, images = await load_chat_images(self.frontend, req)
        ids = render_chat_prompt(self.frontend, req, use, self.template_has_tools, self.encode)
        thinking = self.reasoning_for(ids)
        if thinking is not None:
            structured = thinking.constrain(structured)
        num_prompt_tokens = len(ids)
        prompt: list[int] | dict = ids
        if images:
            # Each placeholder becomes the image's tokens: they count as prompt tokens.
            mm = self.frontend.mm_processor
            num_prompt_tokens += sum(mm.num_tokens(im) - 1 for im in images)
            prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
        return ChatPrompt(req, use, structured, thinking, prompt, num_prompt_tokens)

    def reasoning_for(self, prompt_ids: list[int]) -> RequestReasoning | None:
        """How a chat output after ``prompt_ids`` splits into thinking and answer (None
        without ``server.reasoning_parser``)."""
        if self.reasoning_parser is None:
            return None
        return RequestReasoning.for_prompt(self.reasoning_parser, prompt_ids, self.tokenizer)

    # -- /tokenize, /detokenize -------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.messages is not None:
            req, images = await load_chat_images(self.frontend, req)
            ids = render_chat_prompt(self.frontend, req, None, self.template_has_tools,
                                     self.encode)
            if images:  # the image tokens the engine would see count
                try:
                    ids = self.frontend.mm_processor.expand(ids, images)
                except ValueError as e:
                    raise bad_request(str(e), "messages") from None
        else:
            ids = self.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        if any(t < 0 for t in req.tokens):
            raise bad_request("token ids must be >= 0", "tokens")
        self._check_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


# --------------------------------------------------------------------------- tool calls

def _chat_message(text: str, finish_reason: str | None, use: ToolUse,
                  thinking: RequestReasoning | None = None
                  ) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message: its thinking apart (``thinking``), then its tool calls
    (``finish_reason`` "tool_calls") when the tool-call parser finds any, else its text."""
    reasoning = None
    content: str | None = text
    if thinking is not None:
        split = thinking.split(text)
        reasoning, content = split.reasoning, split.content
    if use.parser is None or content is None:
        message = ChatResponseMessage(content=content)
    else:
        parsed = use.parser.parse(content, final=True)
        calls = [ToolCall(id=new_tool_call_id(),
                          function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.tool_calls]
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        message = ChatResponseMessage(content=parsed.content, tool_calls=calls)
    message.reasoning_content = message.reasoning = reasoning
    return message, finish_reason


# --------------------------------------------------------------------------- usage

def usage_so_far(usage: Usage, continuous: bool) -> dict[str, Any]:
    """``{"usage": ...}`` for a chunk of a ``continuous_usage_stats`` stream, else nothing."""
    if not continuous:
        return {}
    return {"usage": {"prompt_tokens": usage.prompt_tokens,
                      "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}}


def set_cached_tokens(usage: Usage, cached: int) -> None:
    """Usage's ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held."""
    usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
