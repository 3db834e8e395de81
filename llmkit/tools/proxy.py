"""``llmkit proxy``: one OpenAI-compatible endpoint in front of prefill and decode engines.

Each completion or chat request is sent first to a prefill engine (a ``kv_producer``) with
``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; its
response carries the producer's ``kv_transfer_params``, and the original request goes to a
decode engine (a ``kv_consumer``) with them: the decode engine loads the prompt's KV instead of
computing it, and its answer (streamed or not) is passed through unchanged. Engines of each
kind are taken in turn (round robin).

What the proxy cannot split goes to a decode engine whole: requests with ``n > 1`` or a list
of prompts. If the prefill engine fails (unreachable, 5xx), the decode engine computes the
prompt itself; a 4xx from it is the caller's error and is returned as is.

Balancing: each request goes to the engine of its kind with the fewest requests in flight
through this proxy (ties in turn).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from llmkit.config.errors import ConfigError
from llmkit.tools.schema import ProxyConfig

logger = logging.getLogger(__name__)

__all__ = ["build_proxy_app", "run_proxy"]

_PASS_HEADERS = ("authorization",)


def _splittable(path: str, body: dict[str, Any]) -> bool:
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return False
    if path.endswith("/completions") and "chat" not in path:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt) == 1
    return True


class EnginePool:
    """Engines of one kind; ``pick()`` the one with the fewest requests in flight."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = {u: 0 for u in self.urls}
        self._turn = itertools.count()

    def pick(self) -> str:
        start = next(self._turn)
        n = len(self.urls)
        order = [self.urls[(start + i) % n] for i in range(n)]
        url = min(order, key=self.in_flight.__getitem__)
        self.in_flight[url] += 1
        return url

    def done(self, url: str) -> None:
        self.in_flight[url] -= 1


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def build_proxy_app(cfg: ProxyConfig, *, transport: httpx.AsyncBaseTransport | None = None
                    ) -> FastAPI:
    if not cfg.decode_urls:
        raise ConfigError("proxy.decode_urls", cfg.decode_urls,
                          "a list of at least one decode server URL (http://host:port)")
    if not cfg.prefill_urls:
        raise ConfigError("proxy.prefill_urls", cfg.prefill_urls,
                          "a list of at least one prefill server URL (http://host:port)")
    prefill = EnginePool(cfg.prefill_urls)
    decode = EnginePool(cfg.decode_urls)
    client = httpx.AsyncClient(timeout=cfg.request_timeout_s, transport=transport)
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="llmkit proxy", lifespan=lifespan)
    app.state.client = client

    async def forward(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type":
                                           "BadRequestError", "param": None, "code": 400}},
                                status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}
        decode_body = body
        if isinstance(body, dict) and _splittable(path, body):
            engine = prefill.pick()
            url = engine + path
            try:
                r = await client.post(url, json=_prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                logger.warning("proxy: prefill at %s failed (%s); decoding without it", url, e)
                r = None
            finally:
                prefill.done(engine)
            if r is not None and 400 <= r.status_code < 500:
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type"))
            params = r.json().get("kv_transfer_params") if r is not None and \
                r.status_code == 200 else None
            if r is not None and r.status_code != 200:
                logger.warning("proxy: prefill at %s answered %d; decoding without it", url,
                               r.status_code)
            if params:
                decode_body = {**body, "kv_transfer_params": params}
        engine = decode.pick()
        req = client.build_request("POST", engine + path, json=decode_body, headers=headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            decode.done(engine)
            return JSONResponse({"error": {"message": f"the decode engine is unreachable: {e}",
                                           "type": "ServiceUnavailableError", "param": None,
                                           "code": 503}}, status_code=503)

        async def finish() -> None:
            await resp.aclose()
            decode.done(engine)

        return StreamingResponse(resp.aiter_bytes(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 background=BackgroundTask(finish))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(decode.urls[0] + "/v1/models", headers={
            k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS})
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def run_proxy(cfg: ProxyConfig) -> int:
    import uvicorn

    app = build_proxy_app(cfg)
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", cfg.host, cfg.port,
                cfg.prefill_urls, cfg.decode_urls)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
    return 0
