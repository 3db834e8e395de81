"""The OpenAI-compatible HTTP app (FastAPI): routes, errors in OpenAI's body, API-key check.

``build_app(engine, config, metrics=..., api_key=...)`` wires an ``AsyncLLM`` into a FastAPI
app; ``llmkit.entrypoints.serve.run_server`` runs it under uvicorn.

Routes: ``GET /v1/models`` (the base model and its LoRA adapters, each with ``parent`` and the
``sampling_defaults`` a request that leaves a field out gets), ``GET /v1/models/{model}`` (one
of them),
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (only with
``lora.allow_runtime_updates``), ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream`` is true), ``POST /v1/responses`` and ``GET /v1/responses/{id}`` (``responses.py``),
``POST /tokenize``, ``POST /detokenize``, ``GET /health`` (200, or 503
once the engine process is gone), ``GET /metrics`` (Prometheus text), ``GET /docs``;
``GET /v1/engine/stats`` and ``GET /v1/engine/events`` (``engine_view.py``); the pages ``/``
and ``/engine`` (``web.py``).

Errors: ``{"error": {"message", "type", "param", "code"}}`` — 400 for bad JSON, wrong types,
out-of-range values and prompts that do not fit ``max_model_len``; 401 for a missing or wrong
API key (``server.api_key`` or ``LLMKIT_API_KEY``; ``/v1/*``, ``/tokenize`` and
``/detokenize`` need ``Authorization: Bearer KEY``, ``/health``, ``/metrics`` and ``/docs`` do
not); 403 for a LoRA path outside ``lora.allowed_paths``; 404 for an unknown model, adapter or
route; 503 with ``Retry-After`` when ``server.max_waiting_requests`` requests already wait for
their first token; 500 when the engine process has died; 413 for a body over
``server.max_request_bytes`` (``RequestSizeLimit``). ``server.allowed_origins`` lists the
origins whose pages may call the API (CORS; none by default: same origin only).
``server.restart_engine`` starts a new engine core when it dies (``engine_restart.py``).
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmkit.config.schema import EngineConfig
from llmkit.engine.async_llm import AsyncLLM
from llmkit.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from llmkit.entrypoints.openai import completions
from llmkit.entrypoints.openai.embeddings import add_embeddings_routes
from llmkit.entrypoints.openai.engine_restart import keep_engine_running
from llmkit.entrypoints.openai.engine_view import add_engine_view_routes
from llmkit.entrypoints.openai.errors import OpenAIError
from llmkit.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, ErrorResponse,
                                                LoadLoRAAdapterRequest, ModelCard, ModelList,
                                                TokenizeRequest, UnloadLoRAAdapterRequest)
from llmkit.entrypoints.openai.responses import add_responses_routes
from llmkit.entrypoints.openai.serving import OpenAIServing
from llmkit.entrypoints.openai.web import add_web_routes

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body over server.max_request_bytes"},
    500: {"model": ErrorResponse, "description": "The engine is not running"},
    503: {"model": ErrorResponse, "description": "Overloaded; retry after Retry-After seconds"},
}
# completions and chat answer JSON, or server-sent events when `stream` is true
_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {**_ERRORS, 200: {
    "description": "A JSON body, or server-sent events when `stream` is true",
    "content": {"text/event-stream": {}}}}


def served_model_names(config: EngineConfig, model_path: str | None = None) -> list[str]:
    """The name clients use (``model.served_name``, else the preset's name, else the model
    path), then accepted aliases (the preset, the path, its last component)."""
    from pathlib import Path

    m = config.model
    preset = m.name if m.name and m.name != "custom" else None
    path = m.path or model_path
    primary = m.served_name or preset or path or "model"
    names = [primary]
    for alias in (preset, path, model_path, path and Path(path).name, path and Path(path).stem):
        if alias and alias not in names:
            names.append(alias)
    return names


class ApiKeyMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched)."""

    PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" \
                and scope["path"].startswith(self.PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if self.metrics is not None:
                    self.metrics.on_http_error(401)
                err = OpenAIError(401, "Incorrect or missing API key: send the header "
                                       "'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestSizeLimit:
    """A request body larger than ``server.max_request_bytes`` is answered with 413 in OpenAI's
    error body, before it is read whole: by its ``Content-Length`` when it has one, else
    (chunked uploads) as soon as the bytes received pass the limit (the body reader then raises
    an ``HTTPException(413)``, which FastAPI passes on to the app's handler). Pure ASGI, so
    streamed responses and disconnects pass through untouched."""

    def __init__(self, app, max_bytes: int, on_refused=None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused  # called with the status (metrics)

    def message(self) -> str:
        return (f"the request body is larger than the server's limit of {self.max_bytes} "
                "bytes (server.max_request_bytes)")

    def _error(self) -> OpenAIError:
        if self.on_refused is not None:
            self.on_refused(413)
        return OpenAIError(413, self.message(), code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await OpenAIError(400, "the Content-Length header is not a number",
                                      code="invalid_request").response()(scope, receive, send)
                    return
                break
        if length is not None and length > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self.message())
            return message

        await self.app(scope, counting_receive, send)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|[a-z_-]+\[.*\])$")


def _field_path(loc) -> list:
    """The location without ``body`` and pydantic's union-member tags (``str``,
    ``list[int]``, ``function-after[...]``)."""
    return [p for i, p in enumerate(loc) if p != "body"
            and not (i > 1 and isinstance(p, str) and _TYPE_TAG.match(p))]


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    e = errors[0]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return OpenAIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "),
                           code="invalid_json")
    loc = _field_path(e.get("loc", ()))
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    path = ".".join(str(p) for p in loc)
    # A union field reports one error per member type: say them all.
    msgs = []
    for other in errors:
        if _field_path(other.get("loc", ())) == loc:
            msg = other.get("msg", "invalid value").removeprefix("Value error, ")
            if msg not in msgs:
                msgs.append(msg)
    msg = " or ".join(msgs)
    if e.get("type") == "missing":
        message = f"'{path}' is a required field" if path else "a request body is required"
    else:
        shown = e.get("input")
        shown = repr(shown) if not isinstance(shown, (dict, list)) else type(shown).__name__
        message = f"'{path}': {msg} (got {shown})" if path else f"{msg} (got {shown})"
    return OpenAIError(400, message, param=param, code="invalid_value")


def build_app(engine: AsyncLLM, config: EngineConfig, *, metrics: ServerMetrics | None = None,
              api_key: str | None = None, engine_stop_timeout: float = 5.0) -> FastAPI:
    names = served_model_names(config, str(engine.model_source.path))
    serving = OpenAIServing(engine, names, config.lora)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        supervisor = (asyncio.ensure_future(keep_engine_running(engine))
                      if config.server.restart_engine else None)
        yield
        # uvicorn has stopped accepting and waited (server.shutdown_timeout) for requests in
        # flight; whatever still runs is ended here, then the engine process is stopped.
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        engine.fail_in_flight()
        await asyncio.to_thread(engine.shutdown, engine_stop_timeout)

    # Swagger UI (/docs) and ReDoc (/redoc) from assets inside the fastapi-offline package:
    # FastAPI's own pages load them from a CDN, a blank page on a machine without internet.
    app = FastAPIOffline(title="llmkit OpenAI-compatible server", lifespan=lifespan,
                         description="OpenAI-compatible API served by llmkit.")
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics

    def error_response(err: OpenAIError) -> JSONResponse:
        if metrics is not None:
            metrics.on_http_error(err.status)
        return err.response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(exc.status_code)
        return error_response(OpenAIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                          type="server_error"))

    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine is running (an empty body)"},
        503: {"model": ErrorResponse, "description": "The engine is not running"}})
    async def health():
        if engine.is_running:
            return Response(status_code=200)
        if engine.restarting:
            return error_response(OpenAIError(503, f"the engine is restarting after: "
                                                   f"{engine.dead_error}",
                                              type="service_unavailable_error",
                                              code="engine_restarting"))
        return error_response(OpenAIError(503, f"the engine is not running: "
                                               f"{engine.dead_error}",
                                          type="service_unavailable_error",
                                          code="engine_dead"))

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def get_metrics():
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models():
        return serving.list_models()

    # `:path`: a model served under its folder's path has slashes in its id.
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str):
        return serving.models.retrieve(model)

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions.create_completion(serving, request, raw_request)

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await serving.create_chat_completion(request, raw_request)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(request: TokenizeRequest):
        return await serving.tokenize(request)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest):
        return serving.detokenize(request)

    if config.lora.enabled and config.lora.allow_runtime_updates:
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                  responses={**_ERRORS, 403: {"model": ErrorResponse,
                                              "description": "Path outside lora.allowed_paths"}})
        async def load_lora_adapter(request: LoadLoRAAdapterRequest):
            return PlainTextResponse(await serving.models.load(request.lora_name,
                                                               request.lora_path))

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                  responses=_ERRORS)
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
            return PlainTextResponse(await serving.models.unload(request.lora_name))

    add_responses_routes(app, serving, config.server.responses_store_size, _ERRORS)
    add_embeddings_routes(app, serving, _ERRORS)
    add_engine_view_routes(app, engine, events_per_s=config.server.engine_events_per_s)
    add_web_routes(app)

    # Middleware: the last added runs first. CORS answers preflights and labels every answer
    # (401 and 413 included, so a page can read them); then the size limit; then the key.
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics=metrics)
        _document_bearer_auth(app)
    app.add_middleware(RequestSizeLimit, max_bytes=config.server.max_request_bytes,
                       on_refused=metrics.on_http_error if metrics is not None else None)
    if config.server.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.server.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["Retry-After"], max_age=600)
    return app


def _document_bearer_auth(app: FastAPI) -> None:
    """Mark the key-protected operations in the OpenAPI schema (and so in /docs)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
            "type": "http", "scheme": "bearer",
            "description": "server.api_key (or LLMKIT_API_KEY)"}
        for path, ops in schema.get("paths", {}).items():
            if path.startswith(ApiKeyMiddleware.PROTECTED_PREFIXES):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
