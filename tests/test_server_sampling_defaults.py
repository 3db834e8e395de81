"""The model's sampling defaults over HTTP (issue 31.5): every card of ``GET /v1/models`` and
``GET /v1/models/{model}`` carries ``sampling_defaults`` -- what a request that leaves a field
out gets -- read from the model folder's ``generation_config.json``; and the chat page's sliders
start there (Debian's chromium via playwright, skipped when missing), not at fixed values.
"""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from helpers.server_process import SERVER_THREADS, ServerProcess, error_body
from helpers.web_browser import open_page

from llmkit.entrypoints.openai.serving_models import sampling_defaults

# Off the sliders' old 0.05 grid, and unlike SamplingParams' 1.0 / 1.0 and the page's old
# 0.7 / 1.0, so each value can only have come from the model.
TEMPERATURE, TOP_P, TOP_K = 0.33, 0.87, 7


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("defaults") / "tiny-with-defaults"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "do_sample": True}))
    with ServerProcess(model_dir, "model.served_name=tiny", "kv_cache.num_blocks=64",
                       "server.shutdown_timeout=2", SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


def test_sampling_defaults_are_the_models_over_sampling_params():
    d = sampling_defaults({"temperature": 0.2, "top_p": 0.9, "max_tokens": 64})
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (
        0.2, 0.9, 0, 0.0, 1.0, 64)
    assert d.from_model == ["max_tokens", "temperature", "top_p"]
    none = sampling_defaults({})
    assert (none.temperature, none.top_p, none.max_tokens, none.from_model) == (1.0, 1.0, None,
                                                                                  [])


def test_models_say_the_generation_config_defaults(server):
    expected = {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "min_p": 0.0,
                "repetition_penalty": 1.0, "max_tokens": None,
                "from_model": ["temperature", "top_k", "top_p"]}
    listed = httpx.get(server.url("/v1/models"), timeout=30).json()["data"]
    assert [c["id"] for c in listed] == ["tiny"]
    assert listed[0]["sampling_defaults"] == expected
    card = httpx.get(server.url("/v1/models/tiny"), timeout=30)
    assert card.status_code == 200, card.text
    assert card.json()["id"] == "tiny" and card.json()["object"] == "model"
    assert card.json()["sampling_defaults"] == expected
    # the official client's retrieve() reads the same card
    assert server.client().models.retrieve("tiny").sampling_defaults["top_p"] == TOP_P
    missing = httpx.get(server.url("/v1/models/nope"), timeout=30)
    assert missing.status_code == 404 and error_body(missing)["code"] == "model_not_found"


def test_chat_page_starts_at_the_models_defaults(browser, server):
    chat, problems = open_page(browser, server, "/")
    chat.evaluate("localStorage.clear()")  # nothing the user set before
    chat.reload()
    chat.wait_for_selector("body[data-sampling-defaults='tiny']", state="attached")
    assert float(chat.input_value("#temperature")) == pytest.approx(TEMPERATURE)
    assert float(chat.input_value("#top-p")) == pytest.approx(TOP_P)
    assert chat.inner_text("#temperature-value") == f"{TEMPERATURE:.2f}"
    assert chat.inner_text("#top-p-value") == f"{TOP_P:.2f}"
    assert "the model's default" in chat.get_attribute("#temperature", "title")

    # A value the user sets is kept over the model's across a reload; the other still follows.
    chat.focus("#temperature")
    chat.keyboard.press("Home")
    chat.reload()
    chat.wait_for_selector("body[data-sampling-defaults='tiny']", state="attached")
    assert chat.input_value("#temperature") == "0"
    assert float(chat.input_value("#top-p")) == pytest.approx(TOP_P)
    assert not problems, problems
    chat.close()
