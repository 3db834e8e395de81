"""A fake server for the bench tests.

``FakeServer``: a minimal OpenAI-compatible streaming server for the load generator's tests:
it emits ``max_tokens`` chunks with known delays (the first after ``first_delay_s``, then one
every ``gap_s``), so the client's timestamps have known lower bounds.

``tokens_per_chunk=k`` packs k tokens into each chunk (as a busy server does): the chunk is sent
when its last token is due; ``stream_options.continuous_usage_stats`` puts the usage so far on
every chunk (``continuous_usage=False`` ignores it, as a server without it would).

``serial=True`` serves one request at a time (the others wait in a queue, as in a busy engine):
the k-th request's TTFT then includes k - 1 whole services. Prompts whose first token id is
``FAIL_TOKEN`` get a 400 in OpenAI's error body. Runs uvicorn in a thread on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FAIL_TOKEN = 7
# prompts that start with it get tokens without text: only the final chunk (empty text,
# finish_reason) is sent, as llmkit's server does for tokens that decode to nothing
EMPTY_TOKEN = 8


@dataclass
class FakeState:
    requests: list[dict] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0


def make_app(first_delay_s: float = 0.1, gap_s: float = 0.02, serial: bool = False,
             model: str = "fake-model", tokens_per_chunk: int = 1,
             continuous_usage: bool = True):
    app = FastAPI()
    state = FakeState()
    app.state.fake = state
    lock = asyncio.Lock() if serial else None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.requests.append(body)
        prompt = body["prompt"]
        n = int(body.get("max_tokens", 16))
        if isinstance(prompt, list) and prompt and prompt[0] == FAIL_TOKEN:
            return JSONResponse(status_code=400, content={"error": {
                "message": "this prompt is refused", "type": "invalid_request_error",
                "param": "prompt", "code": None}})
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        empty = isinstance(prompt, list) and prompt[0] == EMPTY_TOKEN
        per_chunk = continuous_usage and bool(
            (body.get("stream_options") or {}).get("continuous_usage_stats"))

        async def events():
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                async with (lock if lock is not None else contextlib.nullcontext()):
                    await asyncio.sleep(first_delay_s)
                    for i in range(n):
                        if i:
                            await asyncio.sleep(gap_s)
                        last = i == n - 1
                        if (empty or (i + 1) % tokens_per_chunk) and not last:
                            continue
                        first = i - (i % tokens_per_chunk)
                        text = "" if empty else "".join(f" t{j}" for j in range(first, i + 1))
                        choice = {"index": 0, "text": text,
                                  "logprobs": None, "finish_reason": "length" if last else None}
                        chunk = {"choices": [choice]}
                        if per_chunk:
                            chunk["usage"] = {"prompt_tokens": n_prompt,
                                              "completion_tokens": i + 1,
                                              "total_tokens": n_prompt + i + 1}
                        yield f"data: {json.dumps(chunk)}\n\n"
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n,
                         "total_tokens": n_prompt + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.inflight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeServer:
    def __init__(self, **kwargs) -> None:
        import uvicorn

        self.app = make_app(**kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> FakeState:
        return self.app.state.fake

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
