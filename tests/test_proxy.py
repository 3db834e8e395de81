"""`llmkit proxy`'s routing, in process against scripted engines (httpx MockTransport): the
two hops and their bodies, balancing, what is not split, and the fallbacks."""
from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from llmkit.config.errors import ConfigError
from llmkit.tools.proxy import EnginePool, build_proxy_app
from llmkit.tools.schema import ProxyConfig


class Engines:
    def __init__(self, prefill_status: int = 200) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.prefill_status = prefill_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        host = request.url.host
        self.calls.append((host, body))
        if host.startswith("p"):
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "x"}})
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": host}})
        return httpx.Response(200, json={"choices": [{"text": f"from {host}"}]})


def _client(engines: Engines, prefill=("http://p1", "http://p2"),
            decode=("http://d1", "http://d2")) -> TestClient:
    cfg = ProxyConfig(prefill_urls=list(prefill), decode_urls=list(decode))
    return TestClient(build_proxy_app(cfg, transport=httpx.MockTransport(engines)))


def test_two_hops_with_the_producers_handle_balanced():
    engines = Engines()
    client = _client(engines)
    for i in range(4):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9,
                                                 "stream": True})
        assert r.status_code == 200
    prefills = [c for c in engines.calls if c[0].startswith("p")]
    decodes = [c for c in engines.calls if c[0].startswith("d")]
    assert {h for h, _ in prefills} == {"p1", "p2"} and {h for h, _ in decodes} == {"d1", "d2"}
    for (ph, pb), (dh, db) in zip(prefills, decodes):
        assert pb["max_tokens"] == 1 and pb["stream"] is False
        assert pb["kv_transfer_params"] == {"do_remote_decode": True}
        assert db["max_tokens"] == 9 and db["stream"] is True
        assert db["kv_transfer_params"]["remote_engine_id"] == ph


def test_n_gt_1_and_prompt_lists_go_to_decode_whole():
    engines = Engines()
    client = _client(engines)
    client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    client.post("/v1/chat/completions", json={"messages": [], "n": 2})
    assert [h[0] for h, _ in engines.calls] == ["d", "d"]
    assert all("kv_transfer_params" not in b for _, b in engines.calls)


@pytest.mark.parametrize("status,decoded", [(503, True), (400, False)])
def test_prefill_failures(status, decoded):
    engines = Engines(prefill_status=status)
    r = _client(engines).post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "x"}]})
    if decoded:  # the decode engine computes the prompt itself
        assert r.status_code == 200 and "kv_transfer_params" not in engines.calls[-1][1]
    else:  # the caller's error, as the engine said it
        assert r.status_code == 400 and len(engines.calls) == 1


def test_the_least_busy_engine_is_picked():
    pool = EnginePool(["http://a", "http://b"])
    first = pool.pick()
    second = pool.pick()
    assert {first, second} == {"http://a", "http://b"}
    pool.done(first)
    assert pool.pick() == first  # the other one is still busy


def test_config_errors():
    with pytest.raises(ConfigError, match="proxy.decode_urls"):
        build_proxy_app(ProxyConfig(prefill_urls=["http://p"]))
    with pytest.raises(ConfigError, match="proxy.prefill_urls"):
        build_proxy_app(ProxyConfig(decode_urls=["http://d"]))
