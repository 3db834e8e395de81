"""Saved step graphs: a second engine start in the same cache folder loads the decode graphs
(dynamo's precompile) instead of tracing the model again, computes the same bits, and a
corrupt or stale entry is traced again with a log line, never a crash."""
from __future__ import annotations

import logging
import os

import pytest

from llmkit import LLM, SamplingParams
from llmkit.compilation.inductor import InductorStepGraphs
from llmkit.config.paths import cache_dir

PROMPTS = [[5, 9, 33, 2, 71, 8], [17] * 20, [40, 41, 42]]


def start(model_dir, cache, mode="graphs"):
    return LLM(str(model_dir), dtype="float32", scheduler={"max_num_seqs": 4},
               compilation={"mode": mode, "cache_dir": str(cache)})


def generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([PROMPTS[0]], params, use_tqdm=False)  # one row: the 1-row graph
    outs += llm.generate(PROMPTS, params, use_tqdm=False)  # 3 rows: the dynamic graph
    return [(o.outputs[0].token_ids, [{t: v.logprob for t, v in lp.items()}
                                      for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.slow
def test_second_start_loads_the_graphs(tiny_model_dir, tmp_path, monkeypatch, caplog):
    model_dir = tiny_model_dir("llama")
    cache = tmp_path / "compile"
    # inductor's own code cache stays the shared one (warm after the first run anywhere):
    # what this test is about is the dynamo trace, which it does not cache.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get(
        "TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile")))
    eager = generate(start(model_dir, cache, "eager"))

    cold = start(model_dir, cache)
    graphs = cold.engine.executor.runner.step_graphs
    assert isinstance(graphs, InductorStepGraphs)
    assert graphs.origins == {"one": "traced", "many": "traced"}
    saved = sorted((cache / "step_graphs").glob("*.bin"))
    assert len(saved) == 2
    assert generate(cold) == eager  # the same bits as eager
    del cold

    def no_tracing(self, path, inputs):
        raise AssertionError("a warm start traced a step graph")

    with monkeypatch.context() as m:
        m.setattr(InductorStepGraphs, "_trace", no_tracing)
        warm = start(model_dir, cache)
    graphs = warm.engine.executor.runner.step_graphs
    assert graphs.origins == {"one": "loaded", "many": "loaded"}
    runs = {"n": 0}
    run = InductorStepGraphs.run

    def counting_run(self, *args):
        runs["n"] += 1
        return run(self, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    assert generate(warm) == eager
    assert runs["n"] >= 10  # the decode steps went through the loaded graphs
    del warm

    # A corrupt entry: traced again (and saved again), with a warning; the outputs unchanged.
    saved[0].write_bytes(b"not a graph")
    with caplog.at_level(logging.WARNING, logger="llmkit.compilation.inductor"):
        again = start(model_dir, cache)
    assert "not loaded" in caplog.text and "tracing it again" in caplog.text
    assert sorted(again.engine.executor.runner.step_graphs.origins.values()) == \
        ["loaded", "traced"]
    assert generate(again) == eager


def test_graph_key_follows_the_structure(tiny_model_dir):
    """The key changes with what shapes the graph (a KV cache shape, the block-table width,
    a model's scalar attribute), and not with the weights' values."""
    import torch

    from llmkit.compilation.inductor import graph_key

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    runner = llm.engine.executor.runner
    model, kv = runner.model, runner.kv_caches
    key = graph_key(model, kv, block_table_width=8)
    assert graph_key(model, kv, block_table_width=8) == key
    assert graph_key(model, kv, block_table_width=9) != key
    assert graph_key(model, [torch.zeros(kv[0].shape[0] + 1, *kv[0].shape[1:])] * len(kv),
                     block_table_width=8) != key
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert graph_key(model, kv, block_table_width=8) == key
    norm = model.model.norm
    norm.eps_for_test = 1e-3
    assert graph_key(model, kv, block_table_width=8) != key


def test_the_key_is_the_same_in_another_process(tiny_model_dir, tmp_path):
    """The same config on the same machine finds its saved graphs: nothing that varies from
    one process to the next (an object's id, a timed figure) enters the key. (Two starts of
    one config that traced under two keys had run different code: a commit between them
    changed the model's modules.) Nothing is compiled: the platform's graphs object only."""
    import subprocess
    import sys

    script = ("import sys\nfrom llmkit import LLM\n"
              "r = LLM(sys.argv[1], dtype='float32', compilation={'mode': 'graphs', "
              "'compile_missing': False, 'cache_dir': sys.argv[2]}).engine.executor.runner\n"
              "print('KEY', r.make_step_graphs(r.model, r.kv_caches)._key(16))\n")
    model_dir = str(tiny_model_dir("llama"))

    def key_in_a_process():
        out = subprocess.run([sys.executable, "-c", script, model_dir, str(tmp_path)],
                             capture_output=True, text=True, check=True, timeout=300).stdout
        return [line for line in out.splitlines() if line.startswith("KEY")]

    first = key_in_a_process()
    assert len(first) == 1 and key_in_a_process() == first
