"""Parallelism (issue 22): the shared-memory ring, the step codec, tensor parallel over worker
processes (greedy tokens equal the single-process engine's), a dead worker failing the engine,
and the start-up config errors. Multi-process tests use tiny models and one thread per rank."""
from __future__ import annotations

import os
import signal
import threading
import time
import multiprocessing

import numpy as np
import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.config.openmp_env import WAIT_POLICY_VARS, wait_policy_env
from llmkit.distributed.shm_broadcast import ShmRingBuffer
from llmkit.executor.step_codec import StepDecoder, StepEncoder
from llmkit.sampling.params import StructuredOutputsParams
from llmkit.executor.multiproc import cpu_slices
from llmkit.scheduler.base import CachedRequestData, NewRequestData, SchedulerOutput

PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# -- the ring and the codec (one process) -----------------------------------------------------
def test_ring_broadcasts_every_message_to_every_reader_in_order():
    ctx = multiprocessing.get_context("spawn")
    ring = ShmRingBuffer.create(2, ctx.Semaphore, num_slots=2, slot_bytes=64)
    readers = [ShmRingBuffer.attach(ring.handle, r) for r in range(2)]
    messages = [bytes([i]) * n for i, n in enumerate([0, 1, 58, 59, 200, 1000, 3])]
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].dequeue())

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:  # two slots of 59 payload bytes: most messages span several
        ring.enqueue(m)
    for t in threads:
        t.join(timeout=30)
    assert got == [messages, messages]
    for r in readers:
        r.close()
    ring.close()


def test_ring_writer_fails_instead_of_waiting_on_a_reader_that_is_gone():
    ctx = multiprocessing.get_context("spawn")
    ring = ShmRingBuffer.create(1, ctx.Semaphore, num_slots=1, slot_bytes=64)

    def dead() -> None:
        raise RuntimeError("reader gone")

    ring.enqueue(b"first")  # fills the only slot; nobody reads it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="reader gone"):
        ring.enqueue(b"second", check_alive=dead)
    assert time.monotonic() - t0 < 5
    ring.close()


def test_step_codec_round_trips_a_scheduler_output():
    sp = SamplingParams(temperature=0.5, seed=3, max_tokens=5, logit_bias={1: 2.0},
                        structured_outputs=StructuredOutputsParams(regex="a+"))
    so = SchedulerOutput(
        [NewRequestData("r1", [1, 2, 3], 3, sp, [0, 1], 0, eos_token_id=2)],
        CachedRequestData(["r2"], [[5]], [7], [4]), {"r1": 3, "r2": 1}, 4, {"gone"}, {"p"},
        {"r2": [4, 5]}, ["r1"], np.arange(6, dtype=np.int32).reshape(2, 3))
    back = StepDecoder().decode(StepEncoder().encode(so))
    assert back.scheduled_new_reqs[0].sampling_params == sp
    assert back.scheduled_cached_reqs == so.scheduled_cached_reqs
    assert back.finished_req_ids == {"gone"} and back.preempted_req_ids == {"p"}
    assert back.scheduled_spec_tokens == so.scheduled_spec_tokens
    np.testing.assert_array_equal(back.grammar_bitmask, so.grammar_bitmask)
    assert back.grammar_bitmask.dtype == np.int32


# -- tensor parallel over worker processes ---------------------------------------------------
@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),  # 4 heads / 2 KV heads: one KV head per rank, untied LM head
    # one KV head: replicated on both ranks; tied embeddings (vocab-parallel head); qkv bias
    ("qwen2", {"num_key_value_heads": 1}),
])
def test_tensor_parallel_2_matches_the_single_process_engine(tiny_model_dir, arch, overrides):
    path = str(tiny_model_dir(arch, **overrides))
    single = LLM(path, dtype="float32")
    try:
        want_greedy, want_seeded = _tokens(single), _tokens(single, SEEDED)
    finally:
        single.engine.shutdown()
    llm = LLM(path, dtype="float32", parallel={"tensor_parallel_size": 2})
    try:
        info = llm.engine.backend_info
        assert any(m.startswith("row-parallel[0/2]") for m in info.linear_methods), info
        executor = llm.engine.executor
        assert type(executor).__name__ == "MultiprocExecutor"  # executor=auto
        # parallel.cpu_binding=auto: each rank on its own slice of the usable cores
        assert executor.worker_cpus == cpu_slices(sorted(os.sched_getaffinity(0)), 2) or \
            len(os.sched_getaffinity(0)) < 2
        assert _tokens(llm) == want_greedy
        assert _tokens(llm, SEEDED) == want_seeded  # every rank draws the same samples
    finally:
        llm.engine.shutdown()


def test_cpu_slices_give_each_rank_its_own_cores_or_none():
    assert cpu_slices([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert cpu_slices([4, 5, 6], 2) == [(4,), (5,)]  # the remainder to no rank
    assert cpu_slices([0], 2) == [None, None]  # two ranks on one core: not bound


def test_a_killed_worker_fails_the_engine_within_seconds(tiny_model_dir):
    from llmkit.executor.multiproc import WorkerDiedError

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32",
              parallel={"tensor_parallel_size": 2}, executor="multiproc")
    try:
        # Each worker started with the OpenMP wait policy in its environment (torch loads
        # before run_worker runs): llmkit's short spin on the CPU, or the user's own choice.
        want = wait_policy_env(llm.engine.platform.device.type == "cpu")
        for w in llm.engine.executor.workers:
            with open(f"/proc/{w.proc.pid}/environ", "rb") as f:
                items = [e.decode().partition("=") for e in f.read().split(b"\0") if e]
            assert {k: v for k, _, v in items if k in WAIT_POLICY_VARS} == want
        assert _tokens(llm)  # healthy first
        victim = llm.engine.executor.workers[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 .*exit code -9"):
            _tokens(llm)
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerDiedError):  # and it stays failed
            _tokens(llm)
    finally:
        t0 = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - t0 < 10


# -- start-up errors -------------------------------------------------------------------------
@pytest.mark.parametrize("parallel,executor,key,text", [
    ({"tensor_parallel_size": 3}, "auto", "parallel.tensor_parallel_size",
     "a divisor of the model's 4 attention heads (1, 2, 4)"),
    ({"tensor_parallel_size": 64}, "auto", "parallel.tensor_parallel_size", "at most"),
    ({"tensor_parallel_size": 2}, "uniproc", "executor.name", "multiproc, ray or auto"),
    # quantized weights are not split over ranks: an explicit quantization is refused
    ({"tensor_parallel_size": 2, "model.quantization": "int8"}, "auto", "model.quantization",
     "auto or none with several workers"),
    # pipeline parallel's own errors: tests/test_pipeline_parallel.py
])
def test_parallel_config_errors_at_start_up(tiny_model_dir, parallel, executor, key, text):
    parallel = dict(parallel)
    quantization = parallel.pop("model.quantization", "auto")
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_model_dir("llama")), dtype="float32", parallel=parallel,
            executor=executor, quantization=quantization)
    assert err.value.key == key
    assert text in str(err.value)
    assert "\n" not in str(err.value)


def test_executor_ray_without_ray_is_a_config_error(tiny_model_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"executor.name: .*pip install 'llmkit\[ray\]'"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", executor="ray")


def test_executor_ray_tensor_parallel_2_on_a_local_cluster(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    single = LLM(path, dtype="float32")
    try:
        want = _tokens(single)
    finally:
        single.engine.shutdown()
    import ray

    # executor.ray_address=null: the executor starts a local Ray cluster and stops it after
    llm = LLM(path, dtype="float32", parallel={"tensor_parallel_size": 2}, executor="ray")
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert _tokens(llm) == want
        # The actors' processes started with the OpenMP wait policy (their runtime_env)
        policy = wait_policy_env(llm.engine.platform.device.type == "cpu")
        for actor in llm.engine.executor.actors:
            assert ray.get(actor.__ray_call__.remote(lambda _: {
                k: os.environ[k] for k in WAIT_POLICY_VARS if k in os.environ})) == policy
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()


def test_server_with_tensor_parallel_serves_then_turns_unhealthy_when_a_worker_dies(
        tiny_model_dir, tmp_path):
    import re

    import httpx
    from helpers.processes import wait_for
    from helpers.server_process import ServerProcess

    model_dir = tiny_model_dir("llama")
    server = ServerProcess(model_dir, "parallel.tensor_parallel_size=2", "kv_cache.num_blocks=64",
                           log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        single = LLM(str(model_dir), dtype="float32")
        try:
            want = single.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
        finally:
            single.engine.shutdown()
        client = server.client()
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        m = re.search(r"worker pids rank0=(\d+) rank1=(\d+)", server.log())
        assert m, server.log()[-3000:]
        os.kill(int(m.group(2)), signal.SIGKILL)
        with pytest.raises(Exception):  # the step that needs the dead rank fails, fast
            client.with_options(timeout=30, max_retries=0).completions.create(
                model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert wait_for(lambda: httpx.get(server.url("/health"), timeout=2).status_code == 503,
                        10), server.log()[-3000:]
        assert "worker rank 1" in server.log()
    finally:
        server.stop()


# -- the split itself, every rank in one process (no collectives) ----------------------------
@pytest.mark.parametrize("tp_size", [2, 4])
def test_column_and_row_parallel_shards_recompose_the_full_layers(tp_size):
    import torch

    from llmkit.distributed.group import TensorParallelGroup
    from llmkit.linear.parallel import tensor_parallel_factory
    from llmkit.linear.torch_linear import TorchLinearMethod
    from llmkit.models.layers.linear import Linear, MergedLinear

    torch.manual_seed(0)
    heads, kv_heads, d, hidden = 4, 2, 3, 8
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * d) for n in (heads, kv_heads, kv_heads))
    o, bo = torch.randn(hidden, heads * d), torch.randn(hidden)
    x = torch.randn(5, hidden)
    qkv_parts, o_parts = [], []
    for rank in range(tp_size):
        tp = TensorParallelGroup(rank, tp_size)
        factory = tensor_parallel_factory(lambda spec: TorchLinearMethod(), tp)
        qkv = MergedLinear("qkv", hidden, {"q": heads * d, "k": kv_heads * d, "v": kv_heads * d},
                           bias=True, dtype=torch.float32, linear_method=factory,
                           shard_units=(heads, kv_heads, kv_heads))
        for sid, w, b in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
            qkv.load_weight("weight", w, sid)
            qkv.load_weight("bias", b, sid)
        row = Linear.build("o", heads * d, hidden, bias=True, dtype=torch.float32,
                           linear_method=factory, parallel="row")
        row.load_weight("weight", o)
        row.load_weight("bias", bo)
        qkv_parts.append(qkv(x))
        o_parts.append(row.method.inner.apply(row, x.new_ones(5, heads * d // tp_size)))
    # q: rank r holds heads r*H/tp..; k, v: rank r holds KV head r * kv_heads // tp (replicated
    # when the ranks outnumber the KV heads)
    hq, hkv = heads // tp_size, max(1, kv_heads // tp_size)
    full_q = x @ q.T + bq
    full_k = x @ k.T + bk
    for rank, out in enumerate(qkv_parts):
        torch.testing.assert_close(out[:, :hq * d], full_q[:, rank * hq * d:(rank + 1) * hq * d])
        kv_head = rank * min(tp_size, kv_heads) // tp_size
        torch.testing.assert_close(out[:, hq * d:(hq + hkv) * d],
                                   full_k[:, kv_head * hkv * d:(kv_head + 1) * hkv * d])
    # row parallel: the ranks' partial sums (what the all-reduce adds) are the full layer, with
    # the bias once
    torch.testing.assert_close(sum(o_parts), x.new_ones(5, heads * d) @ o.T + bo)


def test_vocab_parallel_shards_pad_a_vocabulary_that_does_not_divide():
    import torch

    from llmkit.distributed.group import TensorParallelGroup
    from llmkit.models.layers.embedding import VocabEmbedding

    table = torch.randn(7, 4)
    got = []
    for rank in range(2):
        emb = VocabEmbedding(7, 4, torch.float32, TensorParallelGroup(rank, 2))
        emb.weight.weight_loader(emb.weight, table)
        got.append(emb.weight.detach().clone())
    assert got[0].shape == got[1].shape == (4, 4)
    torch.testing.assert_close(torch.cat(got)[:7], table)
    assert torch.count_nonzero(got[1][3]) == 0  # the padded row


def test_llmkit_sim_reads_the_parallel_group():
    from helpers.sim_config import cfg_of

    from llmkit.tools.sim.replay import build_sim_engine

    _, ex, _ = build_sim_engine(cfg_of("sim.model=llama-2-70b", "hardware=h200",
                                       "parallel.tensor_parallel_size=2"))
    assert ex.cost_model.tp == 2
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size"):
        build_sim_engine(cfg_of("sim.model=llama-2-70b", "hardware=h200",
                                "parallel.tensor_parallel_size=2", "sim.tensor_parallel_size=4"))
