"""Multi-LoRA through the OpenAI server: a request's ``model`` picks the adapter (tokens equal
the offline ``LLM`` with that ``LoRARequest``), ``/v1/models`` lists adapters with their
``parent``, runtime load/unload, the ``lora.allowed_paths`` refusals (403, nothing loaded),
bad adapter files (400, the server goes on), unknown adapters (404 in OpenAI's shape) and the
``llmkit:lora_requests_info`` metric."""
from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import pytest

from helpers.lora_adapters import build_adapter
from helpers.processes import paused
from helpers.server_process import SERVER_THREADS, ServerProcess, error_body

from llmkit import LLM, LoRARequest, SamplingParams

PROMPT = "Once upon a time there was a little robot"


class Env:
    server: ServerProcess
    offline: LLM
    base: str
    dirs: dict


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    import torch

    model_dir = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-server")
    allowed, outside = root / "allowed", root / "outside"
    dirs = {"start": build_adapter(model_dir, root / "start", r=8, lora_alpha=16, seed=11),
            "runtime": build_adapter(model_dir, allowed / "runtime", r=16, lora_alpha=16,
                                     seed=12),
            "outside": build_adapter(model_dir, outside / "other", r=8, lora_alpha=8, seed=13)}
    broken = allowed / "broken"
    shutil.copytree(dirs["runtime"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    os.symlink(dirs["outside"], allowed / "link")
    server = ServerProcess(
        model_dir, "kv_cache.num_blocks=256", SERVER_THREADS, "lora.enabled=true",
        "lora.max_loras=2", f"lora.modules=['start={dirs['start']}']",
        "lora.allow_runtime_updates=true", f"lora.allowed_paths=[{allowed}]",
        log_path=root / "server.log")
    e = Env()
    e.server, e.dirs = server, dirs
    threads = torch.get_num_threads()
    try:
        e.offline = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 256},
                        platform={"num_threads": 1}, lora={"enabled": True, "max_loras": 2})
        server.wait_ready()
        e.base = httpx.get(server.url("/v1/models")).json()["data"][0]["id"]
        yield e
    finally:
        server.stop()
        e.offline.shutdown()
        torch.set_num_threads(threads)


def offline(env, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return env.offline.generate([PROMPT], params, lora_request=lora,
                                use_tqdm=False)[0].outputs[0].text


def complete(env, model: str) -> httpx.Response:
    return httpx.post(env.server.url("/v1/completions"), timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def tokens(env, resp: httpx.Response) -> str:
    """The completion's text (compared with the offline engine's)."""
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def models(env) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(env.server.url("/v1/models")).json()["data"]}


def test_model_picks_the_adapter(env):
    listed = models(env)
    assert listed[env.base]["parent"] is None
    assert listed["start"]["parent"] == env.base
    assert listed["start"]["root"] == str(env.dirs["start"])
    base, start = complete(env, env.base), complete(env, "start")
    assert start.json()["model"] == "start" and base.json()["model"] == env.base
    want = offline(env, LoRARequest("start", 1, str(env.dirs["start"])))
    assert tokens(env, start) == want != offline(env, None) == tokens(env, base)
    chat = httpx.post(env.server.url("/v1/chat/completions"), timeout=60, json={
        "model": "start", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "start"


def test_unknown_adapter_is_404(env):
    resp = complete(env, "nope")
    assert resp.status_code == 404
    err = error_body(resp)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "start" in err["message"]


def test_runtime_load_and_unload(env):
    resp = httpx.post(env.server.url("/v1/load_lora_adapter"), json={
        "lora_name": "runtime", "lora_path": str(env.dirs["runtime"])})
    assert resp.status_code == 200, resp.text
    assert models(env)["runtime"]["parent"] == env.base
    want = offline(env, LoRARequest("runtime", 7, str(env.dirs["runtime"])))
    assert tokens(env, complete(env, "runtime")) == want
    again = httpx.post(env.server.url("/v1/load_lora_adapter"), json={
        "lora_name": "runtime", "lora_path": str(env.dirs["runtime"])})
    assert again.status_code == 400 and "already been loaded" in error_body(again)["message"]
    resp = httpx.post(env.server.url("/v1/unload_lora_adapter"), json={"lora_name": "runtime"})
    assert resp.status_code == 200, resp.text
    assert "runtime" not in models(env)
    assert complete(env, "runtime").status_code == 404
    gone = httpx.post(env.server.url("/v1/unload_lora_adapter"), json={"lora_name": "runtime"})
    assert gone.status_code == 404 and error_body(gone)["code"] == "model_not_found"
    # loaded again under the same name: a fresh id, the same tokens
    resp = httpx.post(env.server.url("/v1/load_lora_adapter"), json={
        "lora_name": "runtime", "lora_path": str(env.dirs["runtime"])})
    assert resp.status_code == 200 and tokens(env, complete(env, "runtime")) == want


@pytest.mark.parametrize("where", ["outside", "dotdot", "symlink", "relative"])
def test_paths_outside_the_allowlist_are_403(env, where):
    allowed = env.dirs["runtime"].parent
    path = {"outside": str(env.dirs["outside"]),
            "dotdot": f"{allowed}/../outside/other",
            "symlink": str(allowed / "link"),
            "relative": "other"}[where]
    before = models(env)
    resp = httpx.post(env.server.url("/v1/load_lora_adapter"), json={
        "lora_name": f"evil-{where}", "lora_path": path})
    assert resp.status_code == 403, resp.text
    assert error_body(resp)["code"] == "path_not_allowed"
    assert set(models(env)) == set(before)
    assert complete(env, f"evil-{where}").status_code == 404


def test_bad_adapter_files_are_400_and_the_server_goes_on(env):
    allowed = env.dirs["runtime"].parent
    for name, path, message in (("broken", allowed / "broken", "safetensors"),
                                ("missing", allowed / "missing", "does not exist")):
        resp = httpx.post(env.server.url("/v1/load_lora_adapter"), json={
            "lora_name": name, "lora_path": str(path)})
        assert resp.status_code == 400, resp.text
        assert message in error_body(resp)["message"]
        assert name not in models(env)
    assert complete(env, "start").status_code == 200
    bad_body = httpx.post(env.server.url("/v1/load_lora_adapter"), json={"lora_name": 3})
    assert bad_body.status_code == 400


def test_lora_metrics(env):
    """While a request of adapter ``start`` streams, the info gauge names it as running and the
    per-adapter gauge counts it."""
    body = {"model": "start", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    finished = re.compile(r'^llmkit:request_success_total\{[^}]*finished_reason="length"'
                          r'[^}]*\} (\S+)$', re.M)

    def num_finished(text: str) -> float:
        return float(finished.search(text).group(1))

    # The gauges show the stats of the latest engine step the API process has handled; it
    # applies a step's stats before passing its tokens on, and counts a finished request in
    # the same go. The engine core is frozen (SIGSTOP) while /metrics is read, so the
    # request cannot finish meanwhile, however fast the CPU.
    for _attempt in range(3):
        before = num_finished(httpx.get(env.server.url("/metrics")).text)
        with httpx.stream("POST", env.server.url("/v1/completions"), json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            head = [next(lines) for _ in range(3)]
            with paused(env.server.engine_pid):
                text = httpx.get(env.server.url("/metrics")).text
            events = [json.loads(line[len("data: "):]) for line in [*head, *lines]
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert events and events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]
        # Still in flight when the engine stopped (else it ran all 200 tokens between its
        # second chunk and the SIGSTOP; only then try again)?
        if num_finished(text) == before:
            break
    else:
        pytest.fail("the request always finished before the engine core was stopped")
    info = [line for line in text.splitlines() if line.startswith("llmkit:lora_requests_info{")]
    assert len(info) == 1, text
    assert 'max_lora="2"' in info[0] and 'running_lora_adapters="start"' in info[0]
    running = [line for line in text.splitlines()
               if line.startswith("llmkit:lora_num_requests{") and 'lora_name="start"' in line
               and 'state="running"' in line]
    assert running and running[0].endswith(" 1.0")
