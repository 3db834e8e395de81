"""The errors the OpenAI endpoints answer with, in OpenAI's body ``{"error": {message, type,
param, code}}``: 400 (bad request), 404 (unknown model), 429 (the SLO scheduler refused the
request, with ``Retry-After``), 500 (engine dead), 503 (overloaded, with ``Retry-After``)."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from llmkit.engine.async_llm import EngineOverloadedError, SLORejectedError
from llmkit.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

__all__ = ["OpenAIError", "bad_request", "engine_dead", "overloaded", "param_of", "refused",
           "slo_rejected"]


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


def slo_rejected(err: SLORejectedError) -> OpenAIError:
    """429: ``scheduler.slo_admission=reject`` refused the request; the message is the reason
    (the predicted figure and the objective it misses)."""
    return OpenAIError(429, f"the server cannot meet its service-level objective for this "
                       f"request now ({err}); retry later", type="requests",
                       code="slo_rejected", headers={"Retry-After": "1"})


def refused(err: ValueError) -> OpenAIError:
    """The error for an engine's refusal of a request: 429 for the SLO scheduler's, else
    400."""
    if isinstance(err, SLORejectedError):
        return slo_rejected(err)
    return bad_request(str(err))


def param_of(message: str) -> str | None:
    """The parameter that a ``ValueError``'s message starts with (``"top_p: ..."``)."""
    m = re.match(r"(?:SamplingParams\.)?([a-z_]+):", message)
    return m.group(1) if m else None
