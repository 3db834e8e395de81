"""The server under generated requests (schemathesis, from its own OpenAPI schema, every
operation, valid and invalid cases): no 5xx, every error in OpenAI's shape, answers as the
schema declares; and its request limits (prompt tokens, ``n``, ``logprobs``, ``max_tokens``,
``server.max_request_bytes``) answer 400 or 413 in OpenAI's shape.

A few hundred requests here; ``benchmarks/soak.py`` sends thousands.
"""
from __future__ import annotations


import httpx
import pytest

from helpers.server_process import SERVER_THREADS, ServerProcess, error_body

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128
EXAMPLES_PER_OPERATION = 16  # per mode (valid, invalid): ~230 requests


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir("llama"), f"server.api_key={KEY}",
                       f"model.max_model_len={MAX_MODEL_LEN}", "server.max_request_bytes=65536",
                       "kv_cache.num_blocks=512", SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


def test_generated_requests_get_no_5xx_and_openai_errors(server):
    pytest.importorskip("schemathesis", reason="schemathesis is not installed (test extra)")
    from server_fuzz import fuzz_server

    report = fuzz_server(server.base_url, KEY, EXAMPLES_PER_OPERATION)
    summary = report.summary()
    print("fuzz:", summary)
    paths = {op.split(" ", 1)[1] for op in report.by_operation}
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                 "/detokenize", "/health", "/metrics", "/v1/engine/stats",
                 "/v1/engine/events", "/v1/responses", "/v1/responses/{response_id}",
                 "/v1/embeddings"):
        assert path in paths, path  # every operation was exercised
    assert report.requests >= 200
    assert report.server_errors == 0 and report.num_failures == 0, "\n".join(report.failures)
    assert report.by_status[200] > 0 and report.by_status[400] > 0
    assert "Traceback" not in server.log()
    assert httpx.get(server.url("/health")).status_code == 200


def test_embeddings_from_a_generating_server_are_400_naming_model_runner(server):
    resp = httpx.post(server.url("/v1/embeddings"), headers=AUTH, json={"input": "hi"})
    assert resp.status_code == 400
    assert "model.runner" in error_body(resp)["message"]


def test_generated_embedding_requests_to_a_pooling_server(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("schemathesis", reason="schemathesis is not installed (test extra)")
    from server_fuzz import fuzz_server

    with ServerProcess(tiny_model_dir("qwen3"), "model.runner=pooling",
                       f"model.max_model_len={MAX_MODEL_LEN}", "kv_cache.num_blocks=256",
                       SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("pooling") / "server.log") as srv:
        report = fuzz_server(srv.base_url, None, EXAMPLES_PER_OPERATION,
                             paths=("/v1/embeddings",))
        print("fuzz (pooling):", report.summary())
        assert report.requests >= 16
        assert report.server_errors == 0 and report.num_failures == 0, \
            "\n".join(report.failures)
        assert report.by_status[200] > 0 and report.by_status[400] > 0
        assert "Traceback" not in srv.log()


def test_openai_error_shape_check():
    from server_fuzz import openai_error_problem

    ok = b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}'
    assert openai_error_problem(400, "application/json", ok) is None
    assert openai_error_problem(200, "text/plain", b"x") is None
    assert openai_error_problem(500, "text/plain", b"Internal Server Error")
    assert openai_error_problem(422, "application/json", b'{"detail": []}')
    assert openai_error_problem(400, "application/json", b'{"error": {"message": "m"}}')


@pytest.mark.parametrize("body,param", [
    ({"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1}, "prompt"),  # prompt tokens
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens
    ({"prompt": "hi", "max_tokens": 10 ** 30}, "max_tokens"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
])
def test_request_limits_are_400(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(server.url(path), json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    assert error_body(resp)["param"] == param


def test_request_body_over_the_limit_is_413(server):
    resp = httpx.post(server.url("/v1/completions"), headers=AUTH,
                      json={"prompt": "x" * 70000})
    assert resp.status_code == 413 and error_body(resp)["code"] == "request_too_large"
    resp = httpx.post(server.url("/tokenize"), headers=AUTH, json={"prompt": "x" * 70000})
    assert resp.status_code == 413


# Edge values the generator rarely reaches; each was a 500 before.
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\u00b2": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "priority": 1180591620717411303424}', "priority"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 1180591620717411303424}', "top_k"),
    ("/v1/completions", b'{"prompt": "hi \\ud800"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800 x"}', "prompt"),
])
def test_edge_values_are_400(server, path, raw, param):
    resp = httpx.post(server.url(path), content=raw,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert error_body(resp)["param"] == param
