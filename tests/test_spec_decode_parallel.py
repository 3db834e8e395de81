"""Speculative decoding under tensor parallel (multiproc, TP=2): every rank runs the proposer
(the draft model and the EAGLE head split like the target), proposes the same drafts and
accepts the same tokens, so greedy outputs equal the single-process engine without speculation
and the acceptance counts equal the single-process engine with the same speculation."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from helpers.tiny_models import SUCCESSOR_PROMPTS as PROMPTS
from helpers.tiny_models import build_eagle_head_dir, build_successor_model_dir


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
# prompts in chunks and drafts cut to the budget
LIMITS = {"scheduler": {"max_num_batched_tokens": 16}}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory, tiny_tokenizer):
    target = tiny_model_dir("llama")  # 4 heads, 2 KV heads: one KV head per rank
    return {"random": target, "draft": tiny_model_dir("llama", seed=1),
            "succ": build_successor_model_dir(tmp_path_factory.mktemp("succ"), tiny_tokenizer),
            "eagle": build_eagle_head_dir(target, tmp_path_factory.mktemp("eagle"))}


def _run(path, params, **groups) -> tuple[list[list[int]], object]:
    llm = LLM(str(path), dtype="float32", **groups)
    try:
        tokens = [o.outputs[0].token_ids
                  for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return tokens, llm.engine.stats().spec_decode
    finally:
        llm.engine.shutdown()


_PLAIN: dict = {}


def _plain(path) -> list[list[int]]:
    """Greedy tokens of the single-process engine without speculation (once per model)."""
    if path not in _PLAIN:
        _PLAIN[path] = _run(path, GREEDY, **LIMITS)[0]
    return _PLAIN[path]


@pytest.mark.parametrize("name,target", [("ngram", "succ"), ("draft_model", "random"),
                                         ("eagle", "random")])
def test_tensor_parallel_speculation_equals_the_single_process_engine(name, target, dirs):
    spec = {"name": name, "num_speculative_tokens": 3}
    if name == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        # the target as its own draft: every draft right, so acceptance shows the ranks agree
        spec["model"] = str(dirs["random" if name == "draft_model" else "eagle"])
    plain = _plain(dirs[target])
    single, single_stats = _run(dirs[target], GREEDY, speculative=spec, **LIMITS)
    tp, tp_stats = _run(dirs[target], GREEDY, speculative=spec, parallel=TP2, **LIMITS)
    assert single == plain
    assert tp == plain
    assert tp_stats.num_drafts > 0
    if name != "eagle":  # (a random EAGLE head's drafts are all wrong)
        assert tp_stats.num_accepted_tokens > 0
    # the ranks drafted what one process drafts, and accepted as much
    assert (tp_stats.num_draft_tokens, tp_stats.num_accepted_tokens) == \
        (single_stats.num_draft_tokens, single_stats.num_accepted_tokens)


def test_tensor_parallel_draft_model_sampling_matches_one_process(dirs):
    """Drafts drawn from the draft's distribution (q kept per rank for the verification):
    every rank draws and accepts the same, as the one process does with the same seeds."""
    spec = {"name": "draft_model", "num_speculative_tokens": 2, "model": str(dirs["draft"])}
    single, _ = _run(dirs["random"], SEEDED, speculative=spec)
    tp, stats = _run(dirs["random"], SEEDED, speculative=spec, parallel=TP2)
    assert tp == single
    assert stats.num_drafts > 0


def test_a_draft_model_that_does_not_split_is_a_config_error(dirs, tiny_model_dir):
    draft = tiny_model_dir("llama", num_attention_heads=3, num_key_value_heads=3,
                           hidden_size=48)
    with pytest.raises(ConfigError) as err:
        LLM(str(dirs["random"]), dtype="float32", parallel=TP2,
            speculative={"name": "draft_model", "num_speculative_tokens": 2,
                         "model": str(draft)})
    assert err.value.key == "parallel.tensor_parallel_size"
    assert "draft model's 3 attention heads" in str(err.value)
    assert "\n" not in str(err.value)
