"""A cold start does not wait for its step graphs (compilation.background): the engine answers
at once through eager steps while a daemon thread compiles the graphs, swaps them in between
two steps when they are ready, and computes the same bits after the swap; a failed capture
leaves it eager, a capture still running does not hold up the exit, and a warm start loads the
saved graphs before its first step.

The tests hold the capture at its trace with a gate they open (the tracing itself is the real
one, tens of seconds on 2 cores); the ones that do not compile run in seconds."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from llmkit import LLM, SamplingParams
from llmkit.compilation.inductor import InductorStepGraphs
from llmkit.config.paths import cache_dir

PROMPTS = [[5, 9, 33, 2, 71, 8], [17] * 20, [40, 41, 42]]
REPO = Path(__file__).resolve().parents[1]


def start(model_dir, cache, background=True) -> LLM:
    # No prefix caching: a prompt generated again must be computed as the first time was
    # (a cached prefix's remainder is a chunk, whose float sums need not match the whole).
    return LLM(str(model_dir), dtype="float32", scheduler={"max_num_seqs": 4},
               kv_cache={"enable_prefix_caching": False},
               compilation={"mode": "graphs", "cache_dir": str(cache),
                            "background": background})


def generate(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([PROMPTS[0]], params, use_tqdm=False)  # one row: the 1-row graph
    outs += llm.generate(PROMPTS, params, use_tqdm=False)  # 3 rows: the dynamic graph
    return [(o.outputs[0].token_ids, [{t: v.logprob for t, v in lp.items()}
                                      for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture
def shared_inductor_cache(monkeypatch):
    """inductor's own code cache stays the shared one (warm after the first run anywhere):
    what these tests are about is the dynamo trace and when its graphs are used."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get(
        "TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile")))


@pytest.fixture
def engine_thread_graph_runs(monkeypatch):
    """How many decode steps the engine thread ran through a graph (the capture's warm-up
    runs, on its own thread, are not counted)."""
    runs = {"n": 0}
    run = InductorStepGraphs.run

    def counting_run(self, *args):
        if threading.current_thread() is threading.main_thread():
            runs["n"] += 1
        return run(self, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    return runs


def gate_tracing(monkeypatch) -> threading.Event:
    """The background capture waits at its first trace until the returned event is set."""
    gate = threading.Event()
    trace = InductorStepGraphs._trace

    def gated_trace(self, path, inputs):
        assert threading.current_thread() is not threading.main_thread()
        assert gate.wait(300), "the test never opened the gate"
        return trace(self, path, inputs)

    monkeypatch.setattr(InductorStepGraphs, "_trace", gated_trace)
    return gate


@pytest.mark.slow
def test_cold_start_serves_eagerly_then_swaps_in_the_same_bits(
        tiny_model_dir, tmp_path, monkeypatch, shared_inductor_cache, engine_thread_graph_runs,
        caplog):
    model_dir = tiny_model_dir("llama")
    cache = tmp_path / "compile"
    gate = gate_tracing(monkeypatch)
    with caplog.at_level(logging.INFO, logger="llmkit"):
        llm = start(model_dir, cache)
        runner = llm.engine.executor.runner
        assert runner.step_graphs is None and runner.pending_graphs is not None
        assert llm.engine.backend_info.step_graphs_pending
        before = generate(llm)  # answered while the graphs are still being compiled
        assert engine_thread_graph_runs["n"] == 0  # every step ran eagerly
        assert runner.step_graphs is None and not runner.pending_graphs.done

        gate.set()
        pending = runner.pending_graphs
        assert pending.wait(300) and not pending.failed
        after = generate(llm)
    assert runner.pending_graphs is None and runner.step_graphs is pending.graphs
    assert not llm.engine.backend_info.step_graphs_pending
    assert llm.engine.backend_info.step_graphs == "inductor"
    assert engine_thread_graph_runs["n"] >= 8  # the decode steps went through the graphs
    assert after == before  # the same tokens and logprobs, bit for bit
    assert pending.graphs.origins == {"one": "traced", "many": "traced"}
    assert "use them from now on" in caplog.text
    llm.shutdown()

    # The next start finds the graphs the thread saved and loads them before its first step.
    def no_tracing(self, path, inputs):
        raise AssertionError("a warm start traced a step graph")

    monkeypatch.setattr(InductorStepGraphs, "_trace", no_tracing)
    engine_thread_graph_runs["n"] = 0
    warm = start(model_dir, cache)
    runner = warm.engine.executor.runner
    assert runner.pending_graphs is None
    assert runner.step_graphs.origins == {"one": "loaded", "many": "loaded"}
    assert generate(warm) == before
    assert engine_thread_graph_runs["n"] >= 8
    warm.shutdown()


def test_failed_capture_leaves_the_engine_eager(tiny_model_dir, tmp_path, monkeypatch, caplog,
                                                engine_thread_graph_runs):
    def broken_trace(self, path, inputs):
        raise RuntimeError("inductor fell over")

    monkeypatch.setattr(InductorStepGraphs, "_trace", broken_trace)
    with caplog.at_level(logging.WARNING):
        llm = start(tiny_model_dir("llama"), tmp_path / "compile")
        runner = llm.engine.executor.runner
        assert runner.pending_graphs.wait(60) and runner.pending_graphs.failed
        eager = generate(llm)
    assert "compiling failed; decode steps keep running eagerly" in caplog.text
    assert "inductor fell over" in caplog.text
    assert runner.pending_graphs is None and runner.step_graphs is None
    assert engine_thread_graph_runs["n"] == 0
    assert len(eager) == 4 and all(len(tokens) == 6 for tokens, _ in eager)
    llm.shutdown()


def test_background_false_waits_with_a_progress_line(tiny_model_dir, tmp_path, monkeypatch,
                                                     caplog):
    """compilation.background=false: the start waits for the capture, and says what it
    waits for and how to skip it."""
    import time

    def slow_capture(self, width):
        time.sleep(1.5)  # past the progress line's one second
        return 1.5

    monkeypatch.setattr(InductorStepGraphs, "capture", slow_capture)
    with caplog.at_level(logging.INFO, logger="llmkit.startup"):
        llm = start(tiny_model_dir("llama"), tmp_path / "compile", background=False)
    runner = llm.engine.executor.runner
    assert runner.pending_graphs is None and isinstance(runner.step_graphs, InductorStepGraphs)
    assert "compiling the decode step graphs (inductor, 1-4 rows) before serving " \
           "(compilation.mode=eager skips this) ..." in caplog.text
    assert "done in" in caplog.text
    llm.shutdown()


def test_compile_missing_false_stays_eager_and_never_traces(tiny_model_dir, tmp_path,
                                                           monkeypatch, caplog,
                                                           engine_thread_graph_runs):
    """compilation.compile_missing=false (what `llmkit generate` sets: a one-shot run ends
    long before a compile would, which would only slow it): no graphs saved, nothing is
    traced and every step is eager; `llmkit generate` adds the key unless the user gave it."""
    from llmkit.entrypoints import cli

    def no_tracing(self, path, inputs):
        raise AssertionError("traced a step graph under compile_missing=false")

    monkeypatch.setattr(InductorStepGraphs, "_trace", no_tracing)
    with caplog.at_level(logging.INFO, logger="llmkit"):
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32",
                  compilation={"mode": "graphs", "cache_dir": str(tmp_path / "compile"),
                               "compile_missing": False})
    runner = llm.engine.executor.runner
    assert runner.step_graphs is None and runner.pending_graphs is None
    assert len(generate(llm)) == 4 and engine_thread_graph_runs["n"] == 0
    assert "compilation.compile_missing=false: decode steps run eagerly" in caplog.text
    llm.shutdown()

    seen = {}
    monkeypatch.setattr(cli, "load_config", lambda args: seen.setdefault("o", list(args.overrides)))
    monkeypatch.setattr(cli, "_offline", lambda name: lambda cfg, prompt: 0)
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert seen.pop("o")[-1] == "compilation.compile_missing=false"
    assert cli.main(["generate", "--prompt", "hi", "compilation.compile_missing=true"]) == 0
    assert seen["o"] == ["compilation.compile_missing=true"]


def test_exit_while_compiling_does_not_hang(tiny_model_dir, tmp_path):
    """A capture still running when the program ends does not hold the exit up."""
    script = textwrap.dedent(f"""
        import threading
        from llmkit import LLM, SamplingParams
        from llmkit.compilation.inductor import InductorStepGraphs

        never = threading.Event()
        InductorStepGraphs._trace = lambda self, path, inputs: never.wait()
        llm = LLM({str(tiny_model_dir("llama"))!r}, dtype="float32",
                  compilation={{"mode": "graphs", "cache_dir": {str(tmp_path / "c")!r},
                               "background": True}})
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert llm.engine.executor.runner.pending_graphs is not None
        print("tokens", len(out[0].outputs[0].token_ids), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 3" in proc.stdout


def test_exit_while_the_capture_runs_torch_ops_exits_0(tiny_model_dir, tmp_path):
    """A short run on a cold compile cache ends while the capture thread is inside torch's C++
    (dynamo's trace and inductor's passes run thousands of ops, each giving the GIL up and
    taking it back in a noexcept destructor). CPython ended such a daemon thread with
    pthread_exit there at finalization: "terminate called without an active exception",
    SIGABRT, exit code 134, after the program's output. The exit must stop the thread first
    and keep the program's exit code. The trace is stood in for by torch ops that keep the
    thread in C++ nearly all the time, until it is stopped."""
    script = textwrap.dedent(f"""
        import atexit, threading, time
        import torch
        from llmkit import LLM, SamplingParams
        from llmkit.compilation.inductor import InductorStepGraphs

        inside = threading.Event()

        def ops_until_stopped(self, path, inputs):
            x = torch.ones(1 << 20)
            inside.set()
            while True:
                x.cumsum(0)  # C++, without the GIL

        InductorStepGraphs._trace = ops_until_stopped
        llm = LLM({str(tiny_model_dir("llama"))!r}, dtype="float32",
                  compilation={{"mode": "graphs", "cache_dir": {str(tmp_path / "c")!r},
                               "background": True}})
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        pending = llm.engine.executor.runner.pending_graphs
        assert inside.wait(60) and not pending.done
        ended = time.perf_counter()
        # atexit runs after the threading exit hooks, before the interpreter finalizes
        atexit.register(lambda: print("stopped", pending.done, pending.failed,
                                      f"{{time.perf_counter() - ended:.1f}}", flush=True))
        print("tokens", len(out[0].outputs[0].token_ids), flush=True)
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # cold
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env=env)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 3" in proc.stdout
    stopped = proc.stdout.split("stopped ")[1].split()
    assert stopped[:2] == ["True", "True"], proc.stdout  # ended (failed: not swapped in)
    assert float(stopped[2]) < 3.0, proc.stdout  # promptly, not after a compile


# A sitecustomize for the server's processes: the step graphs' trace waits for a file (the
# gate) to exist. It patches the module when it is first imported, not at start-up: the CLI
# sets the OpenMP environment before anything imports torch.
GATED_SITECUSTOMIZE = '''
import importlib.abc, importlib.util, os, sys, time

class _GateTrace(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "llmkit.compilation.inductor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            trace = module.InductorStepGraphs._trace

            def gated(self, path, inputs):
                while not os.path.exists(os.environ["LLMKIT_TEST_TRACE_GATE"]):
                    time.sleep(0.1)
                return trace(self, path, inputs)

            module.InductorStepGraphs._trace = gated

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _GateTrace())
'''


@pytest.mark.slow
def test_server_answers_while_compiling_and_the_same_after(tiny_model_dir, tmp_path,
                                                           shared_inductor_cache):
    from helpers.processes import wait_for
    from helpers.server_process import PROMPT, SERVER_THREADS, ServerProcess

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GATED_SITECUSTOMIZE)
    gate = tmp_path / "gate"
    srv = ServerProcess(
        tiny_model_dir("llama"), "compilation.mode=graphs", "compilation.background=true",
        f"compilation.cache_dir={tmp_path / 'compile'}", "kv_cache.enable_prefix_caching=false",
        SERVER_THREADS, log_path=tmp_path / "server.log",
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(site),
                                                         os.environ.get("PYTHONPATH")])),
             "LLMKIT_TEST_TRACE_GATE": str(gate)})
    try:
        srv.wait_ready()
        client = srv.client()

        def complete():
            resp = client.completions.create(model=client.models.list().data[0].id,
                                             prompt=PROMPT, max_tokens=8, temperature=0,
                                             logprobs=2)
            lp = resp.choices[0].logprobs
            return resp.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs

        before = complete()
        assert len(before[1]) == 8
        announced = "compiling the decode step graphs (inductor, 1-8 rows) in the background; " \
            "decode steps run eagerly until they are ready (compilation.mode=eager skips this)"
        assert wait_for(lambda: announced + " ..." in srv.log(), timeout=30), srv.log()[-3000:]
        assert "use them from now on" not in srv.log()  # the answer came from eager steps

        gate.touch()
        assert wait_for(lambda: announced + ": done in" in srv.log(), timeout=300,
                        interval=0.5), srv.log()[-3000:]
        after = complete()  # its first step swaps the graphs in
        assert "use them from now on" in srv.log()
        assert after == before  # the same tokens and logprobs, bit for bit
    finally:
        srv.stop()


def test_eager_steps_wait_out_an_fx_trace_on_the_capture_thread():
    """torch.fx's tracer patches torch.nn.Module.__call__ and __getattr__ for the whole process
    while it traces: an eager forward on the engine thread in that window ran through the
    capture's tracer and failed ("module is not installed as a submodule", seen in a cold
    `llmkit bench throughput`). Here the capture thread stays inside a real fx trace until the
    eager step has asked to run; the step must wait for the trace and then compute its own
    result."""
    import torch
    from torch import nn

    from llmkit.worker.step_graph_capture import BackgroundCapture

    inside, eager_asked = threading.Event(), threading.Event()

    class Traced(nn.Module):
        def forward(self, x):
            inside.set()
            eager_asked.wait(10)
            return x + 1

    class Graphs:
        name, max_rows = "fake", 1

        def capture(self, block_table_width: int) -> float:
            torch.fx.symbolic_trace(Traced())
            return 0.0

    eager = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    want = eager(x)
    cap = BackgroundCapture(Graphs(), 1).start()
    assert inside.wait(10)
    threading.Timer(0.3, eager_asked.set).start()  # the trace ends only after the step waits
    with cap.eager_step(), torch.inference_mode():
        got = eager(x)
    assert cap.wait(10) and not cap.failed
    assert torch.equal(got, want)
