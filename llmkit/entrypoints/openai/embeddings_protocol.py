"""Bodies of ``POST /v1/embeddings`` (OpenAI's names and shapes)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from llmkit.entrypoints.openai.protocol import _Request, _Response

_I64 = 2 ** 63 - 1


class EmbeddingRequest(_Request):
    """``input``: a text, texts, token ids or lists of them (one embedding each, in order);
    ``encoding_format``: ``float`` lists or ``base64`` (little-endian float32 bytes, what the
    official client asks for by default); ``dimensions``: truncate to this many (Matryoshka
    models only)."""
    # An example in the OpenAPI schema: docs show it, and the server fuzz sends it first.
    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "The food was good."}]})

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=_I64)
    user: str | None = None
    priority: int = Field(0, ge=-_I64 - 1, le=_I64)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id lists must not be empty")
            flat = v if isinstance(v[0], int) else [t for p in v if isinstance(p, list)
                                                    for t in p]
            if any(t < 0 or t > _I64 for t in flat):
                raise ValueError("token ids must be >= 0")
        return v


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
