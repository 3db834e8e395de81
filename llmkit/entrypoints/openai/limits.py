"""``RequestSizeLimit``: a request body larger than ``server.max_request_bytes`` is answered with
413 in OpenAI's error body, before it is read whole — by its ``Content-Length`` when it has one,
else (chunked uploads) as soon as the bytes received pass the limit: the body reader then raises
an ``HTTPException(413)``, which FastAPI passes on to the app's handler.

Pure ASGI, so streamed responses and disconnects pass through untouched.
"""
from __future__ import annotations

from starlette.exceptions import HTTPException

from llmkit.entrypoints.openai.errors import OpenAIError

__all__ = ["RequestSizeLimit"]


class RequestSizeLimit:
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
                    raise HTTPException(413, self.message())
            return message

        await self.app(scope, counting_receive, send)
