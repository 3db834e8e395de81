"""Pipeline parallel (issue 22 item 3): the layer split, each stage's share of the model, greedy
tokens equal to the single-process engine's with two batches in flight (PP=2, TP=2 x PP=2), a
dead stage failing the engine, the start-up config errors, and the simulator's pipeline (its
bubble and overlap). Multi-process tests use tiny float32 models and one thread per rank."""
from __future__ import annotations

import os
import signal
import time

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.distributed.pipeline import PipelineParallelGroup, get_pp_indices

PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three",
           "Once upon a time", "The weather today is", "Numbers: 4 5 6 7"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
# A small token budget: the prompts' prefills spread over several batches, so the batch queue
# holds two at once from the start.
SCHEDULER = {"max_num_batched_tokens": 12}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


class _InFlight:
    """Records how many other batches were still in flight as each batch's output came."""

    def __init__(self, core) -> None:
        self.core = core
        self.seen: list[int] = []

    def on_step(self, event) -> None:
        self.seen.append(self.core.num_batches_in_flight)


# -- the split ------------------------------------------------------------------------------
def test_layers_split_as_vllm_splits_them():
    assert [get_pp_indices(4, k, 2) for k in range(2)] == [(0, 2), (2, 4)]
    assert [get_pp_indices(3, k, 2) for k in range(2)] == [(0, 2), (2, 3)]
    assert [get_pp_indices(10, k, 4) for k in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(80, k, 2) for k in range(2)] == [(0, 40), (40, 80)]
    with pytest.raises(ValueError):
        get_pp_indices(2, 0, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head / tied (3 layers: 2 + 1)
def test_each_stage_builds_and_loads_only_its_layers(tiny_model_dir, arch):
    import torch

    from llmkit.attention import attention_backend_class
    from llmkit.config.schema import EngineConfig
    from llmkit.models.base import ModelContext
    from llmkit.models.layers.pipeline import PPMissingLayer
    from llmkit.models.loader import build_model, resolve_model_source
    from llmkit.platforms import resolve_platform

    config = EngineConfig.model_validate({"model": {"path": str(tiny_model_dir(arch)),
                                                    "dtype": "float32"}})
    source = resolve_model_source(config.model)
    platform = resolve_platform(config.platform)
    ops = platform.ops(torch.float32)
    attn = attention_backend_class(config.attention, platform)(ops)

    def build(stage: int | None):
        pp = PipelineParallelGroup(stage, 2) if stage is not None else PipelineParallelGroup()
        return build_model(source, ModelContext(attn_backend=attn, ops=ops, pp=pp), "cpu")

    full, first, last = build(None), build(0), build(1)
    num_layers = source.hf_config.num_hidden_layers
    split = get_pp_indices(num_layers, 0, 2)[1]
    assert first.num_layers == split and last.num_layers == num_layers - split
    for i in range(num_layers):
        assert isinstance((last if i < split else first).model.layers[i], PPMissingLayer)
    assert isinstance(first.model.norm, PPMissingLayer)
    assert isinstance(first.lm_head, PPMissingLayer)
    tied = arch == "qwen2"
    assert isinstance(last.model.embed_tokens, PPMissingLayer) != tied  # a tied head needs it
    # Absent, not zero-filled: the stages' parameters are the full model's, split between them
    # (a tied last stage also holds the embedding matrix its head computes with).
    want = dict(full.named_parameters())
    got0, got1 = dict(first.named_parameters()), dict(last.named_parameters())
    shared = {"model.embed_tokens.weight"} if tied else set()
    assert set(got0) & set(got1) == shared
    assert set(got0) | set(got1) == set(want)
    for name, p in [*got0.items(), *got1.items()]:
        assert p.shape == want[name].shape
        assert bool((p == want[name]).all()), name


# -- greedy tokens against the single-process engine -------------------------------------------
@pytest.mark.parametrize("arch,parallel", [
    ("qwen2", {"pipeline_parallel_size": 2}),  # 3 layers, 2 + 1; tied head on the last stage
    # 4 processes; 2 layers, one per stage, untied head
    ("llama", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
])
def test_pipeline_parallel_matches_the_single_process_engine(tiny_model_dir, arch, parallel):
    path = str(tiny_model_dir(arch))
    single = LLM(path, dtype="float32", scheduler=SCHEDULER)
    try:
        want_greedy, want_seeded = _tokens(single), _tokens(single, SEEDED)
    finally:
        single.engine.shutdown()
    llm = LLM(path, dtype="float32", parallel=parallel, scheduler=SCHEDULER)
    try:
        core = llm.engine
        assert type(core.executor).__name__ == "MultiprocExecutor"
        assert core.executor.max_concurrent_batches == 2
        watch = _InFlight(core)
        core.add_step_observer(watch)
        assert _tokens(llm) == want_greedy
        assert _tokens(llm, SEEDED) == want_seeded
        # While a batch's output was taken, the next batch was already in the pipe.
        assert max(watch.seen) == 1, watch.seen
        assert core.num_batches_in_flight == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_executor_ray_pipeline_parallel_2_on_a_local_cluster(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    single = LLM(path, dtype="float32", scheduler=SCHEDULER)
    try:
        want = _tokens(single)
    finally:
        single.engine.shutdown()
    llm = LLM(path, dtype="float32", parallel={"pipeline_parallel_size": 2}, executor="ray",
              scheduler=SCHEDULER)
    try:
        core = llm.engine
        assert type(core.executor).__name__ == "RayExecutor"
        assert core.executor.max_concurrent_batches == 2
        watch = _InFlight(core)
        core.add_step_observer(watch)
        assert _tokens(llm) == want
        assert max(watch.seen) == 1, watch.seen
    finally:
        llm.engine.shutdown()


def test_a_killed_stage_fails_the_engine_within_seconds(tiny_model_dir):
    from llmkit.executor.multiproc import WorkerDiedError

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32",
              parallel={"pipeline_parallel_size": 2}, scheduler=SCHEDULER)
    try:
        assert _tokens(llm)
        # The first stage: the last one (the output rank) would wait on its sends forever.
        victim = llm.engine.executor.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 0 .*exit code -9"):
            _tokens(llm)
        assert time.monotonic() - t0 < 10
    finally:
        t0 = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - t0 < 10


# -- start-up errors -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,key,text", [
    ({"parallel": {"pipeline_parallel_size": 3}}, "parallel.pipeline_parallel_size",
     "at most the model's 2 layers"),
    ({"parallel": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "executor": "uniproc"},
     "executor.name", "multiproc, ray or auto"),
    ({"parallel": {"pipeline_parallel_size": 2}, "lora": {"enabled": True}}, "lora.enabled",
     "not served across pipeline stages"),
    ({"parallel": {"pipeline_parallel_size": 2}, "kv_transfer": {"name": "shared_memory"}},
     "executor.name", "kv_transfer and kv_offload need executor=uniproc"),
    ({"parallel": {"pipeline_parallel_size": 2},
      "speculative": {"name": "ngram", "num_speculative_tokens": 2}},
     "speculative.name", "none with several workers"),
])
def test_pipeline_parallel_config_errors_at_start_up(tiny_model_dir, kwargs, key, text):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_model_dir("llama")), dtype="float32", **kwargs)
    assert err.value.key == key
    assert text in str(err.value)
    assert "\n" not in str(err.value)


def test_more_ranks_than_the_machine_allows_names_the_pipeline_key(tiny_model_dir, monkeypatch):
    from llmkit.executor import parallel_checks

    monkeypatch.setattr(parallel_checks, "max_ranks", lambda platform: (2, "2 for the test"))
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_model_dir("llama")), dtype="float32",
            parallel={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert err.value.key == "parallel.pipeline_parallel_size"
    assert "at most 2 ranks" in str(err.value)


# -- the simulator -----------------------------------------------------------------------------
def _sim(*overrides: str):
    from helpers.sim_config import cfg_of

    from llmkit.tools.sim.replay import build_sim_engine

    return build_sim_engine(cfg_of("sim.model=llama-2-70b", "hardware=h100-sxm", *overrides))


def _decode(rid: str, context: int):
    from llmkit.scheduler.base import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(rid, list(range(context)), context - 1, SamplingParams(max_tokens=8),
                         [0], context - 1)
    return SchedulerOutput([new], CachedRequestData(), {rid: 1}, 1, set(), set())


def test_sim_pipeline_prices_each_stage_and_the_transfer():
    core, ex, _ = _sim("parallel.tensor_parallel_size=4", "parallel.pipeline_parallel_size=2")
    try:
        cm = ex.cost_model
        assert (cm.tp, cm.pp, cm.stage_layers) == (4, 2, (40, 40))
        assert core.executor.max_concurrent_batches == 2
        flat = _sim("parallel.tensor_parallel_size=4")[1].cost_model
        c, one = cm.decode_step(8, 1024), flat.decode_step(8, 1024)
        assert len(c.stage_s) == 2 and c.transfer_s > 0
        assert c.total_s == pytest.approx(c.engine_s + sum(c.stage_s) + c.transfer_s)
        # The same layers in two halves: the stages add up to the unsplit step, plus the hop
        # (the LM head sits on the last stage).
        assert c.total_s == pytest.approx(one.total_s + c.transfer_s, rel=1e-6)
        assert c.stage_s[1] > c.stage_s[0]
        assert cm.weight_bytes_per_device == pytest.approx(cm.weight_bytes / 8)
    finally:
        core.shutdown()


def test_sim_pipeline_bubble_and_overlap():
    """A batch alone pays every stage in turn (the others idle: the bubble); a second batch
    sent behind it finishes one stage-time later, not one full step later."""
    core, ex, clock = _sim("parallel.tensor_parallel_size=4", "parallel.pipeline_parallel_size=2")
    try:
        t0 = clock()
        first = ex.execute_model(_decode("a", 512), non_block=True)
        second = ex.execute_model(_decode("b", 512), non_block=True)
        cost = ex.last_step
        assert clock() == t0  # nothing waited yet
        out = first.result()
        assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
        t1 = clock()
        second.result()
        t2 = clock()
        assert cost.engine_s < min(cost.stage_s)
        assert t1 - t0 == pytest.approx(cost.total_s)
        assert t2 - t1 == pytest.approx(max(cost.stage_s))
        # without pipelining (PP=1) the second step waits for the whole first one
        flat_core, flat, flat_clock = _sim("parallel.tensor_parallel_size=4")
        try:
            assert flat.max_concurrent_batches == 1
            flat.execute_model(_decode("a", 512))
            flat.execute_model(_decode("b", 512))
            assert flat_clock() == pytest.approx(2 * flat.last_step.total_s)
        finally:
            flat_core.shutdown()
    finally:
        core.shutdown()


def test_sim_pipeline_replay_keeps_both_stages_busy():
    """Through the real engine core and scheduler: the scheduler splits the running requests
    over two batches and the batch queue keeps two in flight, so the batches' latencies add up
    to about twice the time that passed (each stage busy with one of them). Without pipeline
    parallel one step runs at a time: they add up to at most the time that passed."""
    from helpers.sim_config import cfg_of

    from llmkit.tools.sim.replay import run_sim

    common = ("sim.model=llama-2-70b", "hardware=h100-sxm", "bench.input_len=256",
              "bench.output_len=32", "bench.num_requests=32")
    pp = run_sim(cfg_of(*common, "parallel.tensor_parallel_size=4",
                        "parallel.pipeline_parallel_size=2"))
    tp = run_sim(cfg_of(*common, "parallel.tensor_parallel_size=8"))
    assert pp["summary"]["completed"] == tp["summary"]["completed"] == 32
    overlap = pp["sim"]["busy_s"] / pp["sim"]["virtual_time_s"]
    assert 1.6 < overlap <= 2.0, overlap
    assert tp["sim"]["busy_s"] / tp["sim"]["virtual_time_s"] <= 1.0 + 1e-9


# -- the scheduler behind a batch queue ------------------------------------------------------
def test_scheduler_keeps_in_flight_requests_out_of_the_next_batch():
    from helpers.scheduler_driver import fake_run, req

    from llmkit.config.schema import SchedulerConfig
    from llmkit.kv_cache import KVCacheManager
    from llmkit.scheduler.token_budget import TokenBudgetScheduler

    kv = KVCacheManager(64, 4, enable_prefix_caching=True, max_model_len=256)
    sched = TokenBudgetScheduler(SchedulerConfig(), kv, max_model_len=256, eos_token_id=0,
                                 pipeline_parallel_size=2)
    for rid in "abcd":
        sched.add_request(req(rid, 6, max_tokens=8))
    prefill = sched.schedule()
    assert sorted(prefill.num_scheduled_tokens) == list("abcd")
    assert not sched.schedule().num_scheduled_tokens  # all four in flight: nothing to add
    fake_run(sched, prefill)
    # Decoding: each batch takes half the running requests; the second one the other half.
    first, second = sched.schedule(), sched.schedule()
    assert len(first.num_scheduled_tokens) == len(second.num_scheduled_tokens) == 2
    assert not set(first.num_scheduled_tokens) & set(second.num_scheduled_tokens)
    assert not sched.schedule().num_scheduled_tokens
    # The stages that do not sample learn each request's next input token from the batch.
    c = first.scheduled_cached_reqs
    for rid, toks in zip(c.req_ids, c.new_token_ids):
        assert toks == [sched.requests[rid].all_token_ids[-1]] == [7]
    fake_run(sched, first)
    assert set(sched.schedule().num_scheduled_tokens) == set(first.num_scheduled_tokens)
