"""The engine core's public observer API and facts (``llmkit/engine/observe/observer.py``):
what tools see of each step without reaching into the scheduler or the executor."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.engine.loop import core as core_module
from llmkit.engine.observe.observer import BatchSplit, StepEvent


class Collect:
    def __init__(self) -> None:
        self.events: list[StepEvent] = []
        self.closed = 0

    def on_step(self, event: StepEvent) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32",
              scheduler={"max_num_batched_tokens": 16}, kv_cache={"enable_prefix_caching": False})
    yield llm
    llm.shutdown()


def test_events_carry_the_step_its_timings_split_and_stats(llm):
    core = llm.engine
    obs = Collect()
    core.add_step_observer(obs)
    core.add_step_observer(obs)  # once only
    try:
        # a 3-token prompt finishing in one step with max_tokens=1 leaves the scheduler in
        # that step: the split, read before the update, still counts it as prefill
        prompts = [[5, 6, 7], [9] * 20]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=1, ignore_eos=True),
                                      SamplingParams(max_tokens=4, ignore_eos=True)],
                            use_tqdm=False)
    finally:
        core.remove_step_observer(obs)
    ev = obs.events
    assert [e.step for e in ev] == list(range(ev[0].step, ev[0].step + len(ev)))
    assert all(e.schedule_s >= 0 and e.execute_s > 0 and e.update_s >= 0 for e in ev)
    assert all(b.start_s >= a.start_s + a.step_s for a, b in zip(ev, ev[1:]))
    # 16-token budget: step 0 = 3 + 13 prompt tokens; step 1 = the other 7 (+ samples)
    assert ev[0].split == BatchSplit(prefill_reqs=2, prefill_tokens=16, prefill_context=16)
    assert ev[1].split == BatchSplit(prefill_reqs=1, prefill_tokens=7, prefill_context=20)
    assert all(e.split.prefill_tokens == 0 and e.split.decode_tokens == 1 for e in ev[2:])
    assert sum(e.split.prefill_tokens for e in ev) == 23
    assert sum(e.split.decode_tokens for e in ev) == 3
    for e in ev:
        assert e.num_scheduled_tokens == e.split.prefill_tokens + e.split.decode_tokens
        assert e.num_reqs == e.split.prefill_reqs + e.split.decode_reqs
        assert e.scheduler_output.total_num_scheduled_tokens == e.num_scheduled_tokens
        assert e.stats.num_running == (0 if e is ev[-1] else 1)
    # the core outputs of each step are the ones the front end received
    tokens = [t for e in ev for o in e.outputs for t in o.new_token_ids]
    assert sorted(tokens) == sorted(t for o in outs for t in o.outputs[0].token_ids)
    sampled = [t for e in ev for ids in e.runner_output.sampled_token_ids for t in ids]
    assert sorted(sampled) == sorted(tokens)
    assert ev[0].outputs[0].finished and ev[-1].stats.kv_usage == 0
    # removed: no more events
    n = len(ev)
    llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(obs.events) == n and obs.closed == 0


def test_a_step_without_observers_computes_no_event(llm, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("split computed without observers")

    monkeypatch.setattr(core_module, "split_prefill_decode", boom)
    assert not llm.engine.step_observers
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_observers_are_closed_at_shutdown_and_must_have_on_step(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    obs = Collect()
    llm.engine.add_step_observer(obs)
    with pytest.raises(TypeError, match="on_step"):
        llm.engine.add_step_observer(object())
    llm.shutdown()
    assert obs.closed == 1


def test_model_facts_and_backend_info(llm, tiny_model_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    facts = llm.engine.model_facts
    assert facts.vocab_size == hf.vocab_size and facts.max_model_len == llm.max_model_len
    assert facts.eos_token_ids and facts.eos_token_ids[0] == facts.eos_token_id
    info = llm.engine.backend_info
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.attention in ("cpu", "torch") and info.ops in ("cpu", "torch")
    assert info.linear_methods and all(isinstance(m, str) for m in info.linear_methods)
    assert info.step_graphs is None and info.step_graphs_max_rows == 0  # tests run eagerly
