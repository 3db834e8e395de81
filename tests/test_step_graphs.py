"""Step graphs (compilation.mode=graphs): decode steps through inductor-compiled graphs of the
same forward compute exactly what eager computes (the graph's nodes are the same C++ kernels),
for one row and for the dynamic 2..8-row graph; other steps stay eager.

These tests compile (tens of seconds each on 2 cores, cached on disk afterwards); every other
test runs eagerly (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.compilation.inductor import InductorStepGraphs, direct_call

PROMPTS = [[5, 9, 33, 2, 71, 8], [17] * 20, [40, 41, 42], [7, 8, 9, 10], [3] * 9]


def generate(model_dir, mode: str, dtype: str, prompts, **groups):
    llm = LLM(str(model_dir), dtype=dtype, compilation={"mode": mode}, **groups)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outs


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_graph_decode_steps_are_bit_identical_to_eager(tiny_model_dir, arch, dtype, monkeypatch):
    model_dir = tiny_model_dir(arch)
    runs = {"graph": 0}
    run = InductorStepGraphs.run

    def counting_run(self, *args):
        runs["graph"] += 1
        return run(self, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    for prompts in (PROMPTS[:1], PROMPTS):  # one row, then 2..5 rows (the dynamic graph)
        _, eager = generate(model_dir, "eager", dtype, prompts)
        assert runs["graph"] == 0
        llm, graph = generate(model_dir, "graphs", dtype, prompts)
        graphs = llm.engine.executor.runner.step_graphs
        assert isinstance(graphs, InductorStepGraphs)
        assert set(graphs._direct) == {"one", "many"}  # steps skip dynamo's prologue
        assert runs["graph"] >= 11  # every decode step of the 12 tokens went through a graph
        runs["graph"] = 0
        for e, g in zip(eager, graph):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
                assert {t: v.logprob for t, v in lp_g.items()} == \
                    {t: v.logprob for t, v in lp_e.items()}  # the same bits


@pytest.mark.slow
def test_the_recorded_graph_calls_are_the_graphs_own(tiny_model_dir):
    """Each graph called with its inputs recorded once computes what dynamo's own call
    computes, for step inputs other than those it was recorded on (each lands in its place)
    and, for the dynamic graph, other row counts; a dynamic graph recorded at one row count
    only is not kept (its row count could not be told from a constant)."""
    llm, _ = generate(tiny_model_dir("llama"), "graphs", "float32", PROMPTS[:1])
    graphs = llm.engine.executor.runner.step_graphs
    width = llm.engine.executor.runner.batch.block_table.shape[1]

    def step_inputs(rows: int, first: int):
        # positions and lengths past the recordings' (0 and 1), a block per row, no KV write
        pos = torch.arange(first, first + rows)
        return (torch.arange(5, 5 + rows) * first % 97, pos, torch.full((rows,), -1),
                (torch.arange(rows, dtype=torch.int32)[:, None] % 3).expand(rows, width)
                .contiguous(), (pos + 1).to(torch.int32))

    with torch.inference_mode():
        for variant, cases in (("one", [(1, 3), (1, 17), (1, 40)]),
                               ("many", [(3, 2), (5, 11), (graphs.max_rows, 7), (2, 30)])):
            fn, _ = graphs._graphs[variant]
            outs = []
            for rows, first in cases:
                step = step_inputs(rows, first)
                outs.append(graphs._direct[variant](*step))
                assert outs[-1].shape[0] == rows
                assert torch.equal(outs[-1], fn(graphs._step, *step)), (variant, rows)
            assert not torch.equal(outs[0][:1], outs[1][:1])
        many, _ = graphs._graphs["many"]
        assert direct_call(many, graphs._step, graphs.dummy_inputs(3, width)) is None


def test_graphs_need_the_cpp_kernels(tiny_model_dir, caplog):
    """With torch ops (native kernels off) the CPU backend has no graph-safe decode path: the
    engine says so and runs eagerly."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", compilation={"mode": "graphs"},
              platform={"native_kernels": "off"})
    assert llm.engine.executor.runner.step_graphs is None
    assert "no graph-safe decode path" in caplog.text


@pytest.mark.slow
def test_graph_decode_steps_with_quantized_weights(tiny_model_dir, tmp_path):
    """The quantized linear (and the packed embedding lookup) inside the step graphs: the
    same bits as eager."""
    from helpers.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_model_dir("mistral"), tmp_path / "q.gguf", "Q4_1")
    _, eager = generate(path, "eager", "float32", PROMPTS[:3])
    llm, graph = generate(path, "graphs", "float32", PROMPTS[:3])
    assert isinstance(llm.engine.executor.runner.step_graphs, InductorStepGraphs)
    assert "quantized:q4_1" in llm.engine.executor.backend_info.linear_methods
    for e, g in zip(eager, graph):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lp_g.items()} == \
                {t: v.logprob for t, v in lp_e.items()}


@pytest.mark.slow
def test_quantized_graphs_cover_rows_past_the_float_linear(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    """Every linear of a kept-GGUF model runs ``quant_linear`` at any row count, so its graphs
    cover decode steps past ``linear_small_batch_max_rows`` (8, where float layers leave the
    C++ linear): 12-row steps through the dynamic graph, the same bits as eager."""
    from helpers.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_model_dir("mistral"), tmp_path / "q.gguf", "Q4_1")
    prompts = [[3 + i, 5, 7 + 2 * i, 11] for i in range(12)]
    rows = []
    run = InductorStepGraphs.run

    def counting_run(self, input_ids, *args):
        rows.append(input_ids.shape[0])
        return run(self, input_ids, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    scheduler = {"max_num_seqs": 16}
    _, eager = generate(path, "eager", "float32", prompts, scheduler=scheduler)
    llm, graph = generate(path, "graphs", "float32", prompts, scheduler=scheduler)
    assert llm.engine.executor.runner.step_graphs.max_rows == 16
    assert rows.count(12) >= 11  # every 12-row decode step went through the graph
    for e, g in zip(eager, graph):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lp_g.items()} == \
                {t: v.logprob for t, v in lp_e.items()}


@pytest.mark.slow
def test_bf16_graph_rows_follow_the_tier(tiny_model_dir, monkeypatch):
    """A bf16 model's layers keep one kernel up to the C++ linear's 8 rows, or in the amx tier
    (the AMX tile linear) up to linear_packed_max_rows: there 12-row steps run through the
    graph, the same bits as eager; elsewhere they stay eager."""
    prompts = [[3 + i, 5, 7 + 2 * i, 11] for i in range(12)]
    rows = []
    run = InductorStepGraphs.run

    def counting_run(self, input_ids, *args):
        rows.append(input_ids.shape[0])
        return run(self, input_ids, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    model_dir, scheduler = tiny_model_dir("qwen3"), {"max_num_seqs": 16}
    _, eager = generate(model_dir, "eager", "bfloat16", prompts, scheduler=scheduler)
    llm, graph = generate(model_dir, "graphs", "bfloat16", prompts, scheduler=scheduler)
    tiles = llm.engine.executor.backend_info.isa == "amx"
    assert llm.engine.executor.runner.step_graphs.max_rows == (16 if tiles else 8)
    assert (rows.count(12) >= 11) if tiles else rows.count(12) == 0
    for e, g in zip(eager, graph):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lp_g.items()} == \
                {t: v.logprob for t, v in lp_e.items()}
