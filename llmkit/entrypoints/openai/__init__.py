"""The OpenAI-compatible server: ``protocol`` (request/response bodies), ``serving`` (endpoint
logic on an ``AsyncLLM``), ``server`` (the FastAPI app), ``metrics`` (its ``GET /metrics``).
Run it with ``llmkit serve``."""
