"""``POST /v1/embeddings`` (OpenAI's): each input's embedding from a pooling engine
(``model.runner=pooling``), through ``AsyncLLM``'s pooling requests (prefill only, the same
scheduler as generation).

``dimensions`` truncates each embedding to its first ``dimensions`` values and normalizes it
again (the pooling normalizes): Matryoshka models only, those whose config declares
``matryoshka_dimensions`` (then one of those) or ``is_matryoshka``; any other model answers 400.
A server that generates answers 400 naming ``model.runner``; an encoder's (BERT's) input longer
than one step (``scheduler.max_num_batched_tokens``: it is never computed in chunks) is a 400
naming that key.
"""
from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from llmkit.engine.async_llm import RequestOutputKind, RequestStream
from llmkit.entrypoints.openai.embeddings_protocol import (EmbeddingData, EmbeddingRequest,
                                                           EmbeddingResponse, EmbeddingUsage)
from llmkit.entrypoints.openai.errors import bad_request, engine_dead
from llmkit.entrypoints.openai.sampling import check_token_ids
from llmkit.entrypoints.openai.serving import OpenAIServing
from llmkit.entrypoints.openai.streaming import (abort_all, admitting, collect,
                                                 run_until_disconnect)
from llmkit.models.pooling_config import PoolingSpec
from llmkit.outputs import EmbeddingRequestOutput

__all__ = ["OpenAIServingEmbeddings", "add_embeddings_routes", "encode_embedding"]


def encode_embedding(vec: list[float], spec: PoolingSpec, dimensions: int | None,
                     encoding_format: str) -> list[float] | str:
    """One embedding as the response carries it: truncated (Matryoshka) and renormalized,
    then a float list or base64 of its little-endian float32 bytes."""
    arr = np.asarray(vec, dtype=np.float32)
    if dimensions is not None and dimensions < arr.shape[0]:
        arr = arr[:dimensions]
        if spec.normalize:
            arr = arr / max(float(np.linalg.norm(arr)), 1e-12)
    if encoding_format == "base64":
        return base64.b64encode(arr.astype("<f4").tobytes()).decode("ascii")
    return arr.tolist()


class OpenAIServingEmbeddings:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    def _inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        s = self.serving
        items: list[Any]
        if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)):
            items = [req.input]
        else:
            items = list(req.input)
        prompts = []
        for i, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input[{i}]"
            ids = s.encode(item, param) if isinstance(item, str) else list(item)
            if not ids:
                raise bad_request("the input is empty (no tokens)", param)
            check_token_ids(ids, param, s.vocab_size)
            limit = self.engine.max_model_len
            if len(ids) > limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens. "
                                  f"However, the input has {len(ids)} tokens. Please shorten "
                                  "it.", param)
            prompts.append(ids)
        return prompts

    async def create(self, req: EmbeddingRequest, raw_request: Request):
        s = self.serving
        s._warn_extra(req)
        lora = s.check_model(req.model)
        s.check_engine()
        spec = s.frontend.pooling
        if spec is None:
            raise bad_request("this server generates (model.runner=generate): embeddings need "
                              "a server started with model.runner=pooling", "model")
        if req.dimensions is not None and not spec.allows_dimensions(req.dimensions):
            allowed = (", ".join(map(str, spec.matryoshka_dimensions))
                       if spec.matryoshka_dimensions else f"1..{spec.dimensions}")
            raise bad_request(
                f"dimensions={req.dimensions}: " + (
                    f"this model's Matryoshka dimensions are {allowed}" if spec.is_matryoshka
                    else "this model does not declare Matryoshka dimensions (its config has "
                         "no matryoshka_dimensions or is_matryoshka), so its embeddings "
                         f"cannot be truncated; leave dimensions out ({spec.dimensions})"),
                "dimensions")
        prompts = self._inputs(req)
        request_id = f"embd-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        with admitting(streams):
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(
                    rid, ids, priority=req.priority, output_kind=RequestOutputKind.FINAL_ONLY,
                    lora_request=lora, pooling=True))
        results = await run_until_disconnect(raw_request, collect(streams),
                                             lambda: abort_all(streams))
        if isinstance(results, Response):
            return results
        data, usage = [], EmbeddingUsage()
        for i, out in enumerate(results):
            if not isinstance(out, EmbeddingRequestOutput):  # ended another way (an abort)
                raise engine_dead(None)
            embedding = out.outputs.embedding
            usage.prompt_tokens += len(out.prompt_token_ids)
            data.append(EmbeddingData(index=i, embedding=encode_embedding(
                embedding, spec, req.dimensions, req.encoding_format)))
        usage.total_tokens = usage.prompt_tokens
        return EmbeddingResponse(id=request_id, model=s.response_model(lora), data=data,
                                 usage=usage)


def add_embeddings_routes(app: FastAPI, serving: OpenAIServing,
                          errors: dict[int | str, dict[str, Any]]) -> OpenAIServingEmbeddings:
    embeddings = OpenAIServingEmbeddings(serving)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def create_embeddings(request: EmbeddingRequest, raw_request: Request):
        return await embeddings.create(request, raw_request)

    return embeddings
