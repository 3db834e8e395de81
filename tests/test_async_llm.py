"""AsyncLLM with its engine core in a child process (ZMQ + msgspec): streaming, abort frees
blocks, fan-out, admission, bad input, engine death, and no orphan engine processes. One engine
process for the module (plus one for the orphan check)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import msgspec
import pytest

from helpers.processes import paused, pid_alive, wait_for  # noqa: E402

from llmkit import LLM, SamplingParams
from llmkit.engine.async_llm import (AsyncLLM, EngineDeadError, EngineOverloadedError,
                                     RequestOutputKind)
from llmkit.engine.process.client import InprocClient
from llmkit.engine.process.core import (AbortRequests, EngineCoreOutputs, EngineCoreRequest,
                                        EngineInput, EngineMessage, RequestTiming, ShutdownEngine,
                                        decode_sampling_params, encode_sampling_params,
                                        make_encoder)
from llmkit.outputs import EngineCoreOutput
from llmkit.scheduler.base import SchedulerStats

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- messages

def test_messages_round_trip_without_pickle():
    enc = make_encoder()
    params = SamplingParams(temperature=0.5, top_k=-1, seed=3, stop_token_ids=[7],
                            max_tokens=None, min_tokens=2, ignore_eos=True)
    req = EngineCoreRequest("r1", [1, 2, 3], encode_sampling_params(params), priority=-2)
    data = enc.encode(req)
    assert b"\x80\x04" not in data[:2]  # msgpack, not a pickle
    back = msgspec.msgpack.Decoder(EngineInput).decode(data)
    assert back == req
    assert decode_sampling_params(back.sampling_params) == params
    for msg in (AbortRequests(["a", "b"]), ShutdownEngine()):
        assert msgspec.msgpack.Decoder(EngineInput).decode(enc.encode(msg)) == msg
    out = EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [5, 6]),
                                     EngineCoreOutput("r2", [], "stop", 9, 16)],
                            stats=SchedulerStats(1, 2, 0.25, 0, 10, 4),
                            timings={"r2": RequestTiming(0.01, 1)}, errors={"x": "bad"})
    assert msgspec.msgpack.Decoder(EngineMessage).decode(enc.encode(out)) == out


def test_sampling_params_cross_by_field_name():
    """Every init field crosses by name, so fields added to SamplingParams cross unchanged."""
    import dataclasses

    params = SamplingParams(temperature=0.7, seed=11)
    d = encode_sampling_params(params)
    assert set(d) == {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    raw = msgspec.msgpack.decode(make_encoder().encode(d))
    assert decode_sampling_params(raw) == params


def test_inproc_client_runs_a_request(tiny_model_dir, loop):
    from llmkit.config.compose import build_config

    cfg = build_config(str(tiny_model_dir("llama")), dtype="float32",
                       groups={"kv_cache": {"num_blocks": 32}, "platform": {"num_threads": 1}})
    client = InprocClient(cfg)
    client.add_request(EngineCoreRequest("a", [5, 6, 7], encode_sampling_params(
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))))
    tokens, finished = [], None
    while client.has_unfinished_requests():
        for out in client.step().outputs:
            tokens += out.new_token_ids
            finished = out.finish_reason or finished
    assert len(tokens) == 4 and finished == "length"
    client.shutdown()


# --------------------------------------------------------------------------- the engine process

@pytest.fixture(scope="module")
def loop():
    import torch

    # One compute thread per process on a small shared box (the engine process, this one).
    threads = torch.get_num_threads()
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
    torch.set_num_threads(threads)


ONE_THREAD = {"num_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module", autouse=True)
def boot(model_dir, tmp_path_factory):
    """Start the module's engine processes first, so that they load while the quick tests
    run: the AsyncLLM's, and one owned by a separate process (for the orphan check)."""
    from llmkit.config.compose import build_config
    from llmkit.engine.process.client import start_engine_core

    # The owner holds only the engine client (no tokenizer, no torch): a light process.
    script = tmp_path_factory.mktemp("owner") / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from llmkit.config.compose import build_config
        from llmkit.engine.process.client import start_engine_core
        if __name__ == "__main__":
            cfg = build_config({str(model_dir)!r}, dtype="float32",
                               groups={{"kv_cache": {{"num_blocks": 16}},
                                        "platform": {{"num_threads": 1}}}})
            client = start_engine_core(cfg)
            client.wait_ready()
            print(client.pid, flush=True)
            time.sleep(300)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    config = build_config(str(model_dir), dtype="float32",
                          groups={"kv_cache": {"num_blocks": 128}, "platform": ONE_THREAD})
    core = start_engine_core(config)
    yield types.SimpleNamespace(owner=owner, core=core, config=config)
    core.shutdown()
    if owner.poll() is None:
        owner.kill()
        owner.wait(10)


@pytest.fixture(scope="module")
def owner(boot):
    return boot.owner


@pytest.fixture(scope="module")
def llm(boot, loop):
    engine = AsyncLLM.from_config(boot.config, engine_core=boot.core)
    yield engine
    engine.shutdown()
    assert wait_for(lambda: not pid_alive(engine.engine_core.pid), 10)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def collect(gen):
    return [out async for out in gen]


def wait_idle(llm: AsyncLLM, loop, timeout: float = 5.0) -> bool:
    async def poll():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = llm.last_stats
            if s is not None and s.num_running == 0 and s.num_waiting == 0 \
                    and s.kv_usage == 0.0 and llm.num_unfinished_requests == 0:
                return True
            await asyncio.sleep(0.02)
        return False
    return loop.run_until_complete(poll())


def test_generate_matches_offline_llm(llm, loop, model_dir):
    prompts = ["Hello, how are you", "The quick brown fox", "What is the capital"]
    offline = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 64},
                  platform=ONE_THREAD)
    expected = offline.generate(prompts, greedy(12), use_tqdm=False)

    async def run():
        return await asyncio.gather(*(collect(llm.generate(p, greedy(12), f"g{i}"))
                                      for i, p in enumerate(prompts)))

    for outs, exp in zip(loop.run_until_complete(run()), expected):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == exp.outputs[0].token_ids
        assert final.outputs[0].text == exp.outputs[0].text
        assert final.prompt_token_ids == exp.prompt_token_ids
        # cumulative: each output extends the previous one
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens)
        assert final.metrics["time_to_first_token"] >= 0


def test_delta_outputs_add_up_to_the_cumulative_text(llm, loop):
    async def run():
        cum = await collect(llm.generate("Once upon a time", greedy(16), "c1"))
        delta = await collect(llm.generate("Once upon a time", greedy(16), "d1",
                                           output_kind=RequestOutputKind.DELTA))
        return cum, delta

    cum, delta = loop.run_until_complete(run())
    assert "".join(o.outputs[0].text for o in delta) == cum[-1].outputs[0].text
    assert [t for o in delta for t in o.outputs[0].token_ids] == cum[-1].outputs[0].token_ids


def test_n_fans_out_with_seeds(llm, loop, model_dir):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, n=3)

    async def run():
        return await collect(llm.generate("Tell me a story", params, "n3",
                                          output_kind=RequestOutputKind.FINAL_ONLY))

    outs = loop.run_until_complete(run())
    assert len(outs) == 1 and outs[0].request_id == "n3"
    assert sorted(c.index for c in outs[0].outputs) == [0, 1, 2]
    # n=1 requests with seed + i give the same samples as the fan-out
    async def single(i):
        return (await collect(llm.generate(
            "Tell me a story", SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8),
            f"s{i}")))[-1].outputs[0].token_ids
    for c in outs[0].outputs:
        assert c.token_ids == loop.run_until_complete(single(c.index))


def test_abort_frees_blocks_at_once(llm, loop):
    async def run():
        outs = []
        async for out in llm.generate("A long story", greedy(400, ignore_eos=True), "ab1",
                                      output_kind=RequestOutputKind.DELTA):
            outs.append(out)
            if len(outs) == 3:
                await llm.abort("ab1")
        return outs

    outs = loop.run_until_complete(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 400
    assert wait_idle(llm, loop)


def test_cancelled_consumer_aborts_its_request(llm, loop):
    # Not left to the CPU's speed: the request runs to nearly the model's context, and at its
    # first output the consumer freezes the engine core, so it is still in flight (the
    # consumer waiting for its next output) when cancelled, whatever the speed.
    pid = llm.engine_core.pid
    params = greedy(llm.max_model_len - 16, ignore_eos=True)

    async def run():
        first = asyncio.Event()
        pause = contextlib.ExitStack()  # the engine core frozen at the first output

        async def consume():
            async for out in llm.generate("Cancel me", params, "cx"):
                if not first.is_set():
                    pause.enter_context(paused(pid))
                    assert not out.finished
                    first.set()

        task = asyncio.ensure_future(consume())
        started = asyncio.ensure_future(first.wait())
        try:
            await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert first.is_set() and not task.done(), task
            assert llm.num_unfinished_requests == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            # aborted, not finished: the engine core has not run a step since the first output
            assert llm.num_unfinished_requests == 0
        finally:
            pause.close()  # resumed
            started.cancel()
            if not task.done():
                task.cancel()

    loop.run_until_complete(run())
    assert wait_idle(llm, loop)


def test_bad_input_raises_before_sending(llm, loop):
    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            await llm.add_request("long", [5] * (llm.max_model_len + 1))
        with pytest.raises(ValueError, match="out of range"):
            await llm.add_request("vocab", [5, llm.vocab_size])
        with pytest.raises(ValueError, match="logit_bias"):
            await llm.add_request("bias", "hi", SamplingParams(logit_bias={llm.vocab_size: 1}))
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("empty", [])
        stream = await llm.add_request("dup", "hello", greedy(2))
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("dup", "hello", greedy(2))
        return await collect(stream)

    outs = loop.run_until_complete(run())
    assert outs[-1].finished
    assert wait_idle(llm, loop)


def test_admission_limit(llm, loop):
    async def run():
        old = llm.max_waiting_requests
        llm.max_waiting_requests = 2
        try:
            a = await llm.add_request("q1", "one", greedy(4))
            b = await llm.add_request("q2", "two", greedy(4))
            with pytest.raises(EngineOverloadedError):
                await llm.add_request("q3", "three", greedy(4))
            with pytest.raises(EngineOverloadedError):  # n counts: 2 engine requests
                await llm.add_request("q4", "four", greedy(4), n=2)
            await collect(a)
            await collect(b)
            c = await llm.add_request("q5", "five", greedy(4))  # room again
            return await collect(c)
        finally:
            llm.max_waiting_requests = old

    assert loop.run_until_complete(run())[-1].finished
    assert llm.num_pending_requests == 0


def test_engine_death_fails_streams_and_new_requests(llm, loop):
    """Runs last in the module: kills the module's engine process."""
    async def run():
        stream = await llm.add_request("doomed", "A long story", greedy(400, ignore_eos=True),
                                       output_kind=RequestOutputKind.DELTA)
        await stream.__anext__()
        os.kill(llm.engine_core.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 5
        with pytest.raises(EngineDeadError):
            await llm.add_request("after", "hello", greedy(2))

    loop.run_until_complete(asyncio.wait_for(run(), 30))
    assert not llm.is_running and llm.errored
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5


def test_engine_exits_when_its_parent_is_killed(owner):
    """No orphans: SIGKILL the process that owns an engine client; the engine follows."""
    engine_pid = int(owner.stdout.readline())
    assert pid_alive(engine_pid)
    owner.kill()
    owner.wait(10)
    assert wait_for(lambda: not pid_alive(engine_pid), 5), "engine process orphaned"
