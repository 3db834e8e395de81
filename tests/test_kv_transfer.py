"""Prefill/decode disaggregation on one machine (kv_transfer=shared_memory): a producer
prefills, a consumer loads the KV and decodes; greedy tokens equal a colocated engine's; a
failed transfer recomputes; no blocks leak on either side, aborts and timeouts included."""
from __future__ import annotations

import random
import time

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.request import Request, RequestStatus

BLOCK = 4


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 600) for _ in range(rng.randrange(9, 40))] for _ in range(n)]


def _engine(model_dir, shm, role: str, engine_id: str, **kv_transfer) -> LLM:
    return LLM(str(model_dir), dtype="float32", attention="torch",
               kv_cache={"num_blocks": 64, "block_size": BLOCK},
               kv_transfer={"name": "shared_memory", "kv_role": role, "engine_id": engine_id,
                            "shm_dir": str(shm), **kv_transfer})


def _params(max_tokens: int, kv: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv} if kv is not None else None)


def _drain(llm: LLM, timeout_s: float = 30.0) -> None:
    """Step until the engine holds nothing (finished transfers included)."""
    end = time.monotonic() + timeout_s
    while llm.engine.has_unfinished_requests():
        assert time.monotonic() < end, "the engine never let go of its requests"
        llm.engine.step()


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def colocated(model):
    llm = LLM(str(model), dtype="float32", attention="torch",
              kv_cache={"num_blocks": 64, "block_size": BLOCK})
    outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(8),
                                                          use_tqdm=False)]
    llm.shutdown()
    return outs


@pytest.fixture
def pair(model, tmp_path):
    # a short timeout: a test whose consumer never reads some KV drains in seconds
    prod = _engine(model, tmp_path, "kv_producer", "prefill-0", transfer_timeout_s=2.0)
    cons = _engine(model, tmp_path, "kv_consumer", "decode-0")
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


def test_disaggregated_greedy_tokens_equal_colocated(pair, colocated):
    prod, cons = pair
    prompts = _prompts()
    handles = [o.kv_transfer_params for o in prod.generate(
        prompts, _params(1, {"do_remote_decode": True}), use_tqdm=False)]
    assert all(h and h["do_remote_prefill"] and h["remote_engine_id"] == "prefill-0"
               for h in handles)
    # the producer holds every prompt's blocks until the consumer has them
    assert prod.engine.kv_cache_manager.num_free_blocks < 64
    outs = cons.generate(prompts, [_params(8, h) for h in handles], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == colocated
    stats = cons.engine.kv_connector.stats
    assert stats.hits_per_tier["remote"] == sum(len(p) - 1 for p in prompts)
    assert stats.loaded_blocks == sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    assert stats.failed_loads == 0
    t0 = time.monotonic()
    _drain(prod)
    assert time.monotonic() - t0 < 1.5, "claimed KV should be freed at once, not at the timeout"
    _assert_no_leak(prod)
    _assert_no_leak(cons)


def test_a_failed_transfer_is_recomputed(pair, colocated):
    prod, cons = pair
    prompts = _prompts()
    handles = [o.kv_transfer_params for o in prod.generate(
        prompts, _params(1, {"do_remote_decode": True}), use_tqdm=False)]
    bogus = dict(handles[0], remote_dir=str(handles[0]["remote_dir"]) + "-gone")
    short = dict(handles[1], remote_block_ids=handles[1]["remote_block_ids"][:1])
    outs = cons.generate(prompts, [_params(8, bogus), _params(8, short),
                                   _params(8, handles[2])], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == colocated
    assert cons.engine.kv_connector.stats.failed_loads == 2
    # what the consumer could not find (another folder) is freed after the timeout; the
    # rest was released by the consumer
    _drain(prod)
    _assert_no_leak(prod)
    _assert_no_leak(cons)


def test_unclaimed_kv_is_freed_after_the_timeout(model, tmp_path):
    prod = _engine(model, tmp_path, "kv_producer", "prefill-t", transfer_timeout_s=0.3)
    out = prod.generate(_prompts(1), _params(1, {"do_remote_decode": True}), use_tqdm=False)
    assert out[0].kv_transfer_params is not None
    assert prod.engine.kv_cache_manager.num_free_blocks < 64
    _drain(prod)
    _assert_no_leak(prod)
    # an aborted producer request hands nothing over and holds nothing
    llm_engine = prod.engine
    llm_engine.add_request(Request("x", _prompts(1)[0], _params(4, {"do_remote_decode": True})))
    llm_engine.step()
    outs = llm_engine.abort_requests(["x"])
    assert outs[0].finish_reason == "abort" and outs[0].kv_transfer_params is None
    _drain(prod)
    _assert_no_leak(prod)
    prod.shutdown()


def test_a_consumer_aborted_while_loading_leaks_nothing(pair, colocated):
    prod, cons = pair
    prompt = _prompts(1)[0]
    handle = prod.generate([prompt], _params(1, {"do_remote_decode": True}),
                           use_tqdm=False)[0].kv_transfer_params
    core = cons.engine
    core.add_request(Request("r", prompt, _params(8, handle)))
    core.step()  # admitted: blocks allocated, the load started
    req = core.scheduler.get_request("r")
    assert req is None or req.status in (RequestStatus.WAITING_FOR_REMOTE_KVS,
                                          RequestStatus.WAITING, RequestStatus.RUNNING)
    core.abort_requests(["r"])
    _drain(cons)
    _drain(prod)
    _assert_no_leak(cons)
    _assert_no_leak(prod)
    # and the engines still serve
    assert cons.generate([_prompts()[0]], _params(8), use_tqdm=False)[0].outputs[0] \
        .token_ids == colocated[0]


def test_config_errors_name_the_key(model, tmp_path):
    with pytest.raises(ConfigError, match="kv_transfer.name"):
        LLM(str(model), dtype="float32", kv_transfer={"name": "nixl"})
    with pytest.raises(ConfigError, match="kv_transfer.kv_role"):
        LLM(str(model), dtype="float32", kv_transfer={"name": "shared_memory",
                                                      "kv_role": "sender"})
    # a disaggregation role without a connector (issue 31.12): a start-up error, not a 400
    # on every request with kv_transfer_params
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(ConfigError) as ei:
            LLM(str(model), dtype="float32", kv_transfer={"kv_role": role})
        assert ei.value.key == "kv_transfer.kv_role" and ei.value.value == role
        assert "kv_transfer=shared_memory" in str(ei.value) and "kv_both" in str(ei.value)


# --------------------------------------------------------------------------- zmq

def _zmq_engine(model_dir, role: str, engine_id: str, port: int, **kv_transfer) -> LLM:
    return LLM(str(model_dir), dtype="float32", attention="torch",
               kv_cache={"num_blocks": 64, "block_size": BLOCK},
               kv_transfer={"name": "zmq", "kv_role": role, "engine_id": engine_id,
                            "side_channel_port": port, **kv_transfer})


def test_zmq_disaggregated_equals_colocated_and_falls_back(model, colocated):
    from helpers.processes import free_port

    port = free_port()
    prod = _zmq_engine(model, "kv_producer", "zprefill", port, transfer_timeout_s=2.0)
    cons = _zmq_engine(model, "kv_consumer", "zdecode", 0, connect_timeout_s=1.0)
    try:
        prompts = _prompts()
        handles = [o.kv_transfer_params for o in prod.generate(
            prompts, _params(1, {"do_remote_decode": True}), use_tqdm=False)]
        assert all(h["remote_address"] == f"tcp://127.0.0.1:{port}" for h in handles)
        # the held blocks reach the producer's worker (its server) with its next step; a
        # server steps on its own, an offline engine when asked
        prod.engine.step()
        # the first one points at a port nobody listens on: recomputed after the timeout
        dead = dict(handles[0], remote_address=f"tcp://127.0.0.1:{free_port()}")
        outs = cons.generate(prompts, [_params(8, dead), _params(8, handles[1]),
                                       _params(8, handles[2])], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == colocated
        stats = cons.engine.kv_connector.stats
        assert stats.failed_loads == 1
        assert stats.loaded_blocks == sum(-(-(len(p) - 1) // BLOCK) for p in prompts[1:])
        _drain(prod)  # two read and released at once, the unclaimed one after the timeout
        _assert_no_leak(prod)
        _assert_no_leak(cons)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_zmq_producer_needs_a_port(model):
    with pytest.raises(ConfigError, match="kv_transfer.side_channel_port"):
        _zmq_engine(model, "kv_producer", "p", 0)


def test_a_consumer_with_offload_tiers_loads_remote_kv_and_offloads(model, tmp_path,
                                                                   colocated):
    """kv_transfer and kv_offload together: a MultiConnector of both."""
    prod = _engine(model, tmp_path, "kv_producer", "prefill-m", transfer_timeout_s=2.0)
    cons = LLM(str(model), dtype="float32", attention="torch",
               kv_cache={"num_blocks": 24, "block_size": BLOCK},
               kv_transfer={"name": "shared_memory", "kv_role": "kv_consumer",
                            "engine_id": "decode-m", "shm_dir": str(tmp_path)},
               kv_offload={"host_gib": 0.01})
    try:
        prompts = _prompts()
        handles = [o.kv_transfer_params for o in prod.generate(
            prompts, _params(1, {"do_remote_decode": True}), use_tqdm=False)]
        outs = cons.generate(prompts, [_params(8, h) for h in handles], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == colocated
        # again without a producer: what the small pool evicted comes from the host tier
        again = [o.outputs[0].token_ids for o in cons.generate(prompts, _params(8),
                                                               use_tqdm=False)]
        assert again == colocated
        stats = cons.engine.stats().kv_connector
        assert stats.hits_per_tier["remote"] == sum(len(p) - 1 for p in prompts)
        assert stats.hits_per_tier.get("host", 0) > 0 and stats.saved_blocks > 0
        _drain(prod)
        for llm in (prod, cons):
            _assert_no_leak(llm)
    finally:
        prod.shutdown()
        cons.shutdown()
