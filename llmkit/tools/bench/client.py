"""The load generator: replays a workload against an OpenAI-compatible server, streaming, and
times every request from the client's side (``httpx`` + asyncio).

Each request is sent at its ``arrival_s`` after the start (or later, while
``max_concurrency`` requests are in flight), as ``POST /v1/completions`` (or
``/v1/chat/completions``) with ``stream: true``, ``stream_options.include_usage`` (so the
server reports exact token counts) and ``continuous_usage_stats`` (vLLM's: every chunk carries
the usage so far, so the tokens of each chunk are known), ``max_tokens`` and ``ignore_eos``.
Each SSE chunk that carries output (text, or a choice's finish) is timed on arrival; a chunk
can carry several tokens (several engine steps' worth under load, or tokens without text of
their own that came with a later one), and ITL gets one entry per token (the chunk's gap split
over its tokens). The metrics are computed by ``llmkit.tools.bench.metrics.request_record``
(definitions there), with the output token count that the server reports in ``usage``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from llmkit.tools.bench.datasets import WorkloadError, WorkloadRequest
from llmkit.tools.bench.metrics import RequestRecord, request_record

__all__ = ["ClientOptions", "LoadResult", "fetch_model_name", "run_load", "run_load_sync"]


@dataclass(slots=True)
class ClientOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    ignore_eos: bool = True
    temperature: float = 0.0
    max_concurrency: int | None = None
    max_duration_s: float | None = None
    progress: bool = True
    warmup_requests: int = 0

    @classmethod
    def from_config(cls, cfg: Any) -> "ClientOptions":
        """From an ``EngineConfig`` (its ``bench`` and ``server`` sections)."""
        b = cfg.bench
        server = cfg.engine.server
        base = b.base_url or f"http://{server.host}:{server.port}"
        key = (b.api_key or os.environ.get("LLMKIT_API_KEY")
               or os.environ.get("OPENAI_API_KEY") or None)
        return cls(base_url=base, endpoint=b.endpoint, model=b.model, api_key=key,
                   timeout_s=b.request_timeout_s, ignore_eos=b.ignore_eos,
                   temperature=b.temperature, max_concurrency=b.max_concurrency,
                   max_duration_s=b.max_duration_s, progress=b.progress,
                   warmup_requests=b.warmup_requests)

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    # requests of the workload that were never sent (the time limit came first)
    num_unsent: int
    model: str
    # time.time() at the start (for the result's metadata)
    started_at: float


def _payload(req: WorkloadRequest, opts: ClientOptions, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.lora_name or model, "max_tokens": req.max_tokens,
                            "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True},
                            "temperature": opts.temperature}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        prompt = req.prompt
        if prompt is None:
            raise WorkloadError("bench.endpoint=chat needs text prompts: set "
                             "bench.prompt_format=text or use a jsonl dataset of text")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = req.payload_prompt
    return body


def _is_output_chunk(obj: dict[str, Any], chat: bool) -> bool:
    """Whether an SSE chunk carries output: generated text, or the finish of a choice (whose
    last tokens may have no text of their own, e.g. special tokens that are skipped). A chat
    chunk with only the assistant's role is not output."""
    for choice in obj.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text or choice.get("finish_reason"):
            return True
    return False


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except Exception:  # noqa: BLE001 - any body
        msg = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {msg}"


async def fetch_model_name(client: Any, opts: ClientOptions) -> str:
    """``opts.model``, else the first model that ``GET /v1/models`` lists."""
    if opts.model:
        return opts.model
    resp = await client.get(f"{opts.root}/v1/models", headers=opts.headers)
    if resp.status_code != 200:
        err = _error_text(resp.status_code, resp.content)
        raise RuntimeError(f"GET {opts.root}/v1/models: {err}; set bench.model=NAME")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{opts.root}/v1/models lists no model; set bench.model=NAME")
    return data[0]["id"]


async def _one(client: Any, req: WorkloadRequest, opts: ClientOptions, model: str, t0: float,
               sem: asyncio.Semaphore | None, clock: Callable[[], float]
               ) -> RequestRecord | None:
    """Send one request at its arrival time; ``None`` if it was never sent (cancelled first)."""
    scheduled = t0 + req.arrival_s
    sent: float | None = None
    chunks: list[float] = []
    # tokens each chunk carried, from the usage so far (None: the server sends no per-chunk
    # usage; request_record then counts one token a chunk)
    chunk_tokens: list[int] | None = []
    counted = 0
    usage: dict[str, Any] = {}
    error: str | None = None
    chat = opts.endpoint == "chat"
    url = f"{opts.root}/v1/{'chat/completions' if chat else 'completions'}"
    try:
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with (sem if sem is not None else contextlib.nullcontext()):
            body = _payload(req, opts, model)
            sent = clock()
            try:
                async with client.stream("POST", url, json=body, headers=opts.headers) as resp:
                    if resp.status_code != 200:
                        error = _error_text(resp.status_code, await resp.aread())
                    else:
                        async for line in resp.aiter_lines():
                            now = clock()
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            obj = json.loads(data)
                            if "error" in obj:
                                error = str((obj["error"] or {}).get("message", obj["error"]))
                                break
                            if obj.get("usage"):
                                usage = obj["usage"]
                            if _is_output_chunk(obj, chat):
                                chunks.append(now)
                                if chunk_tokens is not None:
                                    if obj.get("usage"):
                                        so_far = int(usage.get("completion_tokens", counted))
                                        chunk_tokens.append(so_far - counted)
                                        counted = so_far
                                    else:
                                        chunk_tokens = None
            except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash
                error = f"{type(e).__name__}: {e}"
            end = clock()
    except asyncio.CancelledError:
        if sent is None:
            return None
        end = clock()
        error = "cancelled: bench.max_duration_s reached"
    return request_record(
        sent, chunks, end,
        output_tokens=usage.get("completion_tokens", len(chunks) if chunks else 0)
        if not error else len(chunks),
        chunk_tokens=chunk_tokens if chunk_tokens and not error else None,
        prompt_tokens=usage.get("prompt_tokens", req.prompt_len),
        ok=error is None and bool(chunks), error=error, request_id=req.request_id,
        start_s=sent - t0, queue_ms=max(0.0, 1e3 * (sent - scheduled)))


def warmup_request(first: WorkloadRequest, i: int) -> WorkloadRequest:
    """An untimed request shaped like ``first`` whose prompt is ``first``'s reversed (and
    rotated by ``i``): the same length, no prefix shared with the workload's, so the timed
    requests find nothing of it in the prefix cache."""
    ids = text = None
    if first.prompt_token_ids is not None:
        ids = list(reversed(first.prompt_token_ids))
        ids = ids[i % len(ids):] + ids[:i % len(ids)] if ids else ids
    if first.prompt is not None:
        text = first.prompt[::-1]
    return WorkloadRequest(f"warmup-{i}", min(first.max_tokens, 2), 0.0, ids, text,
                           first.prompt_len)


async def run_load(workload: Sequence[WorkloadRequest], opts: ClientOptions, *,
                   clock: Callable[[], float] = time.perf_counter,
                   client: Any = None) -> LoadResult:
    """Replay ``workload``; returns one record per request that was sent, in workload order."""
    import httpx

    own_client = client is None
    if own_client:
        limits = httpx.Limits(max_connections=opts.max_concurrency,
                              max_keepalive_connections=opts.max_concurrency)
        # trust_env=False: never route benchmark traffic through a proxy from the environment.
        client = httpx.AsyncClient(timeout=httpx.Timeout(opts.timeout_s, connect=30.0),
                                   limits=limits, trust_env=False)
    try:
        model = await fetch_model_name(client, opts)
        if workload:
            for i in range(opts.warmup_requests):
                warm = warmup_request(workload[0], i)
                await _one(client, warm, opts, model, clock(), None, clock)
        limit = opts.max_duration_s
        todo = [r for r in workload if limit is None or r.arrival_s < limit]
        sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        bar = None
        if opts.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), desc="bench serve", unit="req", file=sys.stderr)
        started_at = time.time()
        t0 = clock()
        tasks = [asyncio.create_task(_one(client, r, opts, model, t0, sem, clock))
                 for r in todo]
        if bar is not None:
            for t in tasks:
                t.add_done_callback(lambda _t: bar.update(1))
        try:
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=limit)
                for t in pending:
                    t.cancel()
            results = await asyncio.gather(*tasks)
        finally:
            if bar is not None:
                bar.close()
        duration = clock() - t0
        records = [r for r in results if r is not None]
        return LoadResult(records, duration, len(workload) - len(records), model, started_at)
    finally:
        if own_client:
            await client.aclose()


def run_load_sync(workload: Sequence[WorkloadRequest], opts: ClientOptions) -> LoadResult:
    return asyncio.run(run_load(workload, opts))
