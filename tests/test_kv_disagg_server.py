"""Disaggregated serving end to end: `llmkit serve` as a kv_producer and as a kv_consumer
(kv_transfer=shared_memory) behind `llmkit proxy`, through the `openai` client: the same
greedy text as a colocated engine, streamed and not; the decode engine really loaded the
prompt's KV (its usage reports it as cached); a failed transfer recomputes; no engine keeps
blocks once the requests are done."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from helpers.processes import free_port, wait_for
from helpers.server_process import ServerProcess

from llmkit import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox jumps over the lazy dog and then",
           "What is the capital of France? Paris is the capital of France, and"]
MAX_TOKENS = 8


class ProxyProcess:
    def __init__(self, prefill: list[str], decode: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.log_path = log_path
        cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "proxy",
               f"proxy.prefill_urls=[{','.join(prefill)}]",
               f"proxy.decode_urls=[{','.join(decode)}]", f"proxy.port={self.port}"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            try:
                return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        if not wait_for(up, timeout, 0.25):
            pytest.fail(f"proxy not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _kv_usage(server: ServerProcess) -> float:
    return server.metrics()["llmkit:kv_cache_usage_perc"]


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("disagg")
    shm = tmp / "shm"
    common = ("attention=torch", "kv_cache.block_size=4", "kv_cache.num_blocks=128",
              "platform.num_threads=1", "kv_transfer=shared_memory",
              f"kv_transfer.shm_dir={shm}", "kv_transfer.transfer_timeout_s=5")
    prefill = ServerProcess(model, *common, "kv_transfer.kv_role=kv_producer",
                            "kv_transfer.engine_id=prefill-0", log_path=tmp / "prefill.log")
    decode = ServerProcess(model, *common, "kv_transfer.kv_role=kv_consumer",
                           "kv_transfer.engine_id=decode-0", log_path=tmp / "decode.log")
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = ProxyProcess([prefill.base_url], [decode.base_url], tmp / "proxy.log")
        proxy.wait_ready()
        import torch
        torch.set_num_threads(1)
        offline = LLM(str(model), dtype="float32", attention="torch",
                      kv_cache={"block_size": 4, "num_blocks": 128})
        yield model, prefill, decode, proxy, offline
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completions_through_the_proxy_equal_colocated(env):
    model, prefill, decode, proxy, offline = env
    client = _client(proxy.base_url)
    for prompt in PROMPTS:
        want = offline.generate([prompt], _greedy(), use_tqdm=False)[0]
        n_prompt = len(want.prompt_token_ids)
        r = client.completions.create(model=str(model), prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0)
        assert r.choices[0].text == want.outputs[0].text
        # the decode engine loaded all but the last prompt token's KV
        assert r.usage.prompt_tokens_details.cached_tokens == n_prompt - 1
        chunks = client.completions.create(model=str(model), prompt=prompt,
                                           max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert wait_for(lambda: _kv_usage(prefill) == 0.0 and _kv_usage(decode) == 0.0, 10.0), \
        "blocks still held after the requests ended"
    m = decode.metrics()
    remote = [v for k, v in m.items() if "kv_connector_hit_tokens" in k and 'tier="remote"' in k]
    # at least every prompt's first transfer (a second one finds most blocks cached locally)
    assert remote and remote[0] >= sum(
        len(offline.generate([p], _greedy(), use_tqdm=False)[0].prompt_token_ids) - 1
        for p in PROMPTS)
    assert m["llmkit:kv_connector_loaded_blocks_total"] > 0
    assert m["llmkit:kv_connector_failed_loads_total"] == 0


def test_chat_through_the_proxy_equal_colocated(env):
    model, prefill, decode, proxy, offline = env
    client = _client(proxy.base_url)
    messages = [{"role": "user", "content": "Tell me a story about a small robot."}]
    want = offline.chat(messages, _greedy(), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=str(model), messages=messages,
                                       max_tokens=MAX_TOKENS, temperature=0.0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    chunks = client.chat.completions.create(model=str(model), messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert wait_for(lambda: _kv_usage(prefill) == 0.0 and _kv_usage(decode) == 0.0, 10.0)


def test_a_failed_transfer_is_recomputed_with_the_same_text(env):
    model, prefill, decode, proxy, offline = env
    prompt = PROMPTS[0]
    want = offline.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0].text
    handle = httpx.post(prefill.base_url + "/v1/completions", timeout=60, json={
        "model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert handle["remote_engine_id"] == "prefill-0"
    bad = dict(handle, remote_dir=handle["remote_dir"] + "-missing")
    r = httpx.post(decode.base_url + "/v1/completions", timeout=60, json={
        "model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "kv_transfer_params": bad}).json()
    assert r["choices"][0]["text"] == want
    # the producer frees the unclaimed blocks after kv_transfer.transfer_timeout_s
    assert wait_for(lambda: _kv_usage(prefill) == 0.0 and _kv_usage(decode) == 0.0, 20.0)


def test_kv_transfer_params_without_a_connector_is_a_400(env):
    model, prefill, decode, proxy, offline = env
    r = httpx.post(decode.base_url + "/v1/completions", timeout=30, json={
        "model": str(model), "prompt": ["a", "b"], "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
