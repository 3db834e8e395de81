"""Data parallel (issue 22 item 4): the router's rule (load, prefix affinity, fallback), the
stats sum, the placement of engine cores on the machine and the start-up config errors (all
in this process); then DP=2 through ``LLM`` and through ``llmkit serve`` with concurrent
requests, whose greedy tokens equal the single-core engine's, and a killed engine core that
fails its own requests and turns ``/health`` to 503. Tiny float32 models, one thread per core.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest

from helpers.processes import pid_alive, wait_for

from llmkit import LLM, LoRARequest, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.engine.process.client import EngineDeadError
from llmkit.engine.dp.placement import (CorePlacement, check_data_parallel_config,
                                        core_config, plan_placements)
from llmkit.engine.dp.router import DPRouter, prefix_keys
from llmkit.engine.dp.stats import combine_scheduler_stats
from llmkit.sampling.params import StructuredOutputsParams
from llmkit.scheduler.base import SchedulerStats, SpecDecodeStats

PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three",
           "Once upon a time there", "The answer is", "A B C D E F G"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# -- the router's rule -----------------------------------------------------------------------
def test_router_balances_by_reported_load_and_requests_sent_since():
    r = DPRouter(2)
    # Nothing reported yet: each request routed counts as waiting on its core.
    assert [r.route([f"r{i}"]) for i in range(4)] == [0, 1, 0, 1]
    r.report(0, num_waiting=0, num_running=5)
    r.report(1, num_waiting=0, num_running=1)
    assert r.route(["a"]) == 1
    # A waiting request weighs 4 running ones (vLLM's score): 4*1 + 0 > 0 + 3.
    r.report(0, num_waiting=1, num_running=0)
    r.report(1, num_waiting=0, num_running=3)
    assert r.route(["b"]) == 1
    assert r.owner("b") == 1 and r.owner("r0") == 0
    r.finished(["b"])
    assert r.owner("b") is None


def test_router_keeps_a_prefix_on_its_core_unless_it_is_much_busier():
    r = DPRouter(2, block_size=4, affinity_slack=2, affinity_ratio=0.5)
    shared = list(range(100, 108))  # two full blocks
    keys = prefix_keys(shared + [1, 2], 4, 4)
    assert len(keys) == 2
    assert r.route(["p1"], keys) == 0  # first seen: the least-loaded core, which now owns it
    r.report(0, 0, 2)  # core 0 a little busier (within the slack of 2)
    r.report(1, 0, 0)
    assert r.route(["p2"], keys) == 0
    assert r.route(["other"], prefix_keys([7] * 8, 4, 4)) == 1  # a new prefix: least loaded
    r.report(0, 0, 9)  # now much busier: 9 > 0 + max(2, 0.5 * 0)
    r.report(1, 0, 0)
    assert r.route(["p3"], keys) == 1
    assert (r.num_affinity_hits, r.num_affinity_fallbacks) == (1, 1)
    r.report(0, 0, 0)
    r.report(1, 0, 1)
    assert r.route(["p4"], keys) == 1  # the prefix moved with the fallback
    # The ratio: 16 vs 10 is within 0.5 * 10 + ... no: 6 > max(2, 5) -> fallback; 14 vs 10 stays.
    r.report(1, 0, 14)
    r.report(0, 0, 10)
    assert r.route(["p5"], keys) == 1
    r.report(1, 0, 16)
    r.report(0, 0, 10)
    assert r.route(["p6"], keys) == 0


def test_router_prefers_the_longest_remembered_prefix_and_skips_dead_cores():
    r = DPRouter(3, block_size=2)
    a = prefix_keys([1, 2, 3, 4, 5, 6], 2, 4)
    r.assign(["y"], 1, a[:2])  # core 1 served the first two blocks
    r.assign(["x"], 2, a[:1])  # then core 2 the first one (it now owns that key)
    assert r.choose(a) == 1
    assert r.mark_dead(1) == ["y"]
    assert r.choose(a) == 2  # the next-longest prefix's core
    r.mark_dead(2)
    assert r.choose(a) == 0
    r.mark_dead(0)
    with pytest.raises(RuntimeError, match="no engine core is alive"):
        r.choose(a)


def test_prefix_keys_cover_full_blocks_and_separate_adapters():
    assert prefix_keys([1, 2, 3], 4, 4) == []  # shorter than a block: no affinity
    k = prefix_keys(list(range(10)), 4, 4)
    assert len(k) == 2 and k == prefix_keys(list(range(8)) + [99, 98], 4, 4)
    assert prefix_keys(list(range(10)), 4, 1) == k[:1]
    assert prefix_keys(list(range(8)), 4, 4, root=(1, None, ())) != k  # another LoRA adapter
    # chained: the second key depends on the first block too
    assert prefix_keys([9, 9, 9, 9, 4, 5, 6, 7], 4, 4)[1] != k[1]


def test_stats_sum_over_the_cores():
    a = SchedulerStats(2, 1, 0.5, 3, 100, 40, spec_decode=SpecDecodeStats(1, 4, 2, [1, 1]),
                       running_lora_adapters={"x": 1})
    b = SchedulerStats(1, 0, 0.25, 1, 50, 10, spec_decode=SpecDecodeStats(2, 4, 3, [2, 1, 0]),
                       running_lora_adapters={"x": 2, "y": 1})
    s = combine_scheduler_stats([a, b], [100, 300])
    assert (s.num_running, s.num_waiting, s.num_preemptions_total) == (3, 1, 4)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (150, 50)
    assert s.kv_usage == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)
    assert s.spec_decode.accepted_per_position == [3, 2, 0]
    assert s.running_lora_adapters == {"x": 3, "y": 1}
    assert combine_scheduler_stats([None, None], [1, 1]) is None
    assert combine_scheduler_stats([a, None], [100, 100]).kv_usage == pytest.approx(0.25)


# -- placement and start-up errors -------------------------------------------------------------
def _config(**sections) -> EngineConfig:
    return EngineConfig.model_validate({"model": {"path": "/nowhere"}, "platform": {"name": "cpu"},
                                        **sections})


def test_each_engine_core_gets_its_own_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    two = plan_placements(_config(parallel={"data_parallel_size": 2}))
    assert two == [CorePlacement(0, (4, 5), 2), CorePlacement(1, (6, 7), 2)]
    # TP inside each core: its workers split the core's slice (they inherit the binding).
    tp = plan_placements(_config(parallel={"data_parallel_size": 2, "tensor_parallel_size": 2}))
    assert [p.cpus for p in tp] == [(4, 5), (6, 7)]
    # More engine cores than CPUs: nothing bound, one thread each.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    three = plan_placements(_config(parallel={"data_parallel_size": 3}))
    assert [(p.cpus, p.num_threads) for p in three] == [(None, 1)] * 3
    cfg = core_config(_config(parallel={"data_parallel_size": 2},
                              observability={"trace_file": "/tmp/t.json"}), two[1])
    assert cfg.parallel.data_parallel_size == 1 and cfg.platform.num_threads == 2
    assert cfg.observability.trace_file == "/tmp/t.engine1.json"


def test_sizes_that_do_not_fit_and_unsupported_combinations_are_config_errors(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_size: .*at most 2"):
        plan_placements(_config(parallel={"data_parallel_size": 3, "tensor_parallel_size": 2}))
    dp2 = {"parallel": {"data_parallel_size": 2}}
    for section, key in [({"kv_transfer": {"name": "shared_memory"}}, "kv_transfer.name"),
                         ({"kv_offload": {"disk_path": "/tmp/x"}}, "kv_offload.disk_path"),
                         ({"executor": {"name": "ray"}}, "executor.name")]:
        with pytest.raises(ConfigError, match=re.escape(key) + ".*data_parallel_size > 1"):
            check_data_parallel_config(_config(**dp2, **section))
    check_data_parallel_config(_config(kv_transfer={"name": "shared_memory"}))  # DP=1: fine


def test_one_engine_core_refuses_data_parallel(tiny_model_dir):
    from llmkit.config.compose import build_config
    from llmkit.engine.loop.core import EngineCore

    cfg = build_config(str(tiny_model_dir("llama")), dtype="float32",
                       groups={"parallel": {"data_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_size: .*1 for one"):
        EngineCore(cfg)


# -- DP=2 through LLM --------------------------------------------------------------------------
def test_llm_data_parallel_2_matches_the_single_core_engine(tiny_model_dir, tmp_path):
    from helpers.lora_adapters import build_adapter

    model_dir = tiny_model_dir("llama")
    path = str(model_dir)
    adapter = LoRARequest("a", 1, str(build_adapter(model_dir, tmp_path / "a", r=8,
                                                    lora_alpha=16, seed=1)))
    loras = [None, adapter] * (len(PROMPTS) // 2)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=2, ignore_eos=True)
    same = dict(dtype="float32", kv_cache={"block_size": 4},
                lora={"enabled": True, "max_loras": 2, "max_lora_rank": 8})
    single = LLM(path, **same)
    try:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
        want_n = [[c.token_ids for c in o.outputs]
                  for o in single.generate(PROMPTS[:2], seeded, use_tqdm=False)]
        want_lora = [o.outputs[0].token_ids for o in single.generate(
            PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)]
    finally:
        single.shutdown()
    assert want_lora != want  # the adapter changes the tokens: its test below means something
    llm = LLM(path, parallel={"data_parallel_size": 2}, **same)
    try:
        engine = llm.engine
        assert type(engine).__name__ == "DataParallelEngine" and engine.num_cores == 2
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        per_core = engine.client.per_core_stats
        assert all(s is not None and s.prefix_cache_queries > 0 for s in per_core), per_core
        total = engine.stats()
        assert total.prefix_cache_queries == sum(s.prefix_cache_queries for s in per_core)
        assert total.num_running == 0 and total.num_waiting == 0
        # n=2: both samples on one core, the same samples as the single core's.
        got_n = [[c.token_ids for c in o.outputs]
                 for o in llm.generate(PROMPTS[:2], seeded, use_tqdm=False)]
        assert got_n == want_n
        # LoRA: every core loads the adapter; each request runs with its own.
        got_lora = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)]
        assert got_lora == want_lora
        assert [lr.lora_name for lr in llm.list_loras()] == ["a"]
        # An abort (leaving a stream) reaches the owning core, which frees the request.
        for _ in llm.stream(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)):
            break
        assert not engine.has_unfinished_requests()
        assert wait_for(lambda: engine.stats().num_running + engine.stats().num_waiting == 0, 10)
        # Prefix affinity end to end: a prompt sharing two full blocks with an earlier one
        # goes to that core and hits its prefix cache.
        router = engine.client.router
        long = "The quick brown fox jumps over the lazy dog and runs far away"
        llm.generate([long], GREEDY, use_tqdm=False)
        hits_before = engine.stats().prefix_cache_hits
        affinity_before = router.num_affinity_hits
        llm.generate([long + " again"], GREEDY, use_tqdm=False)
        assert router.num_affinity_hits == affinity_before + 1
        assert engine.stats().prefix_cache_hits > hits_before
        # A killed core: the next request fails at once, naming it (no hang).
        os.kill(engine.client.cores[1].proc.pid, signal.SIGKILL)
        assert wait_for(lambda: engine.client.is_dead, 10)
        with pytest.raises(EngineDeadError, match="engine core 1 of 2"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


# -- DP=2 behind llmkit serve ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    from helpers.server_process import ServerProcess

    model_dir = tiny_model_dir("llama")
    server = ServerProcess(model_dir, "parallel.data_parallel_size=2",
                           "kv_cache.num_blocks=256", "server.engine_events_per_s=0",
                           "server.restart_engine=true",
                           log_path=tmp_path_factory.mktemp("dp-server") / "server.log",
                           env={"OMP_NUM_THREADS": "1"})
    pids: list[int] = []
    try:
        offline = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 256},
                      platform={"num_threads": 1})
        try:
            want = {p: o.outputs[0].text
                    for p, o in zip(PROMPTS, offline.generate(PROMPTS, GREEDY, use_tqdm=False))}
            choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=
                                    StructuredOutputsParams(choice=CHOICES))
            want["choice"] = offline.generate([PROMPTS[0]], choice,
                                              use_tqdm=False)[0].outputs[0].text
        finally:
            offline.shutdown()
        server.wait_ready()
        m = re.search(r"engine core process pids ([\d,]+)", server.log())
        assert m, server.log()[-3000:]
        pids = [int(p) for p in m.group(1).split(",")]
        yield server, want, pids
    finally:
        server.stop()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_server_data_parallel_2_concurrent_requests_match_the_single_core(dp_server):
    """Greedy texts (8 tokens each) equal the offline single-core engine's, as
    test_server.py compares the server with the offline engine."""
    server, want, pids = dp_server
    assert len(pids) == 2
    client = server.async_client()

    async def one(prompt: str) -> str:
        r = await client.completions.create(model=client_model, prompt=prompt, max_tokens=8,
                                            temperature=0.0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        return r.choices[0].text

    client_model = server.client().models.list().data[0].id

    async def constrained() -> str:  # structured output: compiled on the owning core
        r = await client.completions.create(model=client_model, prompt=PROMPTS[0],
                                            max_tokens=8, temperature=0.0,
                                            extra_body={"structured_outputs":
                                                        {"choice": CHOICES}})
        return r.choices[0].text

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in PROMPTS), constrained())

    got = asyncio.run(all_of_them())
    assert dict(zip([*PROMPTS, "choice"], got)) == want
    assert want["choice"] in CHOICES
    metrics = server.metrics()
    for i in (0, 1):
        assert metrics[f'llmkit:engine_core_up{{engine="{i}",model_name="{client_model}"}}'] == 1
    assert metrics["llmkit:engine_up"] == 1
    assert metrics["llmkit:prefix_cache_queries_total"] > 0


def test_server_a_killed_engine_core_fails_its_requests_503_then_restarts(dp_server):
    server, want, pids = dp_server
    client = server.client()
    model = client.models.list().data[0].id
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 100,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    # Core 0 frozen: the first stream (two idle cores: core 0) stays in flight there for sure;
    # the second goes to core 1 (core 0 now has a request) and runs.
    os.kill(pids[0], signal.SIGSTOP)
    try:
        with httpx.stream("POST", server.url("/v1/completions"), json=body,
                          timeout=60) as first:
            assert first.status_code == 200
            with httpx.stream("POST", server.url("/v1/completions"),
                              json={**body, "max_tokens": 200}, timeout=60) as second:
                second_lines = second.iter_lines()
                assert next(line for line in second_lines if line.startswith("data:"))
                os.kill(pids[0], signal.SIGKILL)
                t0 = time.monotonic()
                rest = "\n".join(first.iter_lines())  # an error event, not a hang
                assert time.monotonic() - t0 < 30
                assert "engine core 0 of 2" in rest and "died" in rest, rest[-500:]
                rest2 = "\n".join(second_lines)  # core 1's request finishes normally
                assert '"finish_reason": "length"' in rest2 and "died" not in rest2, \
                    rest2[-500:]
    finally:
        if pid_alive(pids[0]):
            os.kill(pids[0], signal.SIGKILL)
    # Down (503) until server.restart_engine has a new process in core 0's place.
    health = httpx.get(server.url("/health"), timeout=5)
    assert health.status_code == 503, health.text
    assert health.json()["error"]["code"] in ("engine_dead", "engine_restarting")
    assert "engine core 0" in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 500 and "engine core 0" in str(e.value)
    assert wait_for(lambda: httpx.get(server.url("/health"), timeout=5).status_code == 200,
                    240, interval=0.5), server.log()[-3000:]
    assert "engine core 0 restarted" in server.log()
    metrics = server.metrics()
    for i in (0, 1):
        assert metrics[f'llmkit:engine_core_up{{engine="{i}",model_name="{model}"}}'] == 1
    assert metrics["llmkit:engine_up"] == 1
    # Both cores serve again, with the same tokens.
    r = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0.0,
                                   extra_body={"ignore_eos": True}).choices[0].text
         for p in PROMPTS[:2]]
    assert r == [want[p] for p in PROMPTS[:2]]
