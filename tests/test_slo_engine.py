"""scheduler=slo in the engine: the same greedy tokens as the token-budget scheduler (the SLO
decides how a step is cut, never what a request computes), start-up saying which hardware
profile the cost model uses, and offline rejections as finished outputs with the reason."""
from __future__ import annotations

import logging
import random

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError

MAX_TOKENS = 24


def prompts(n: int = 6, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 600) for _ in range(k)] for k in (40, 7, 63, 19, 33, 50)[:n]]


def generate(model_dir, *overrides: str):
    llm = LLM(str(model_dir), dtype="float32", overrides=list(overrides))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return llm, outs


def test_same_greedy_tokens_as_the_token_budget_scheduler(tiny_model_dir, caplog):
    """tpot_ms=0.001: no step fits, so the SLO scheduler prefills in one-block chunks beside
    the decodes (a very different schedule from the token-budget one's)."""
    model_dir = tiny_model_dir("llama")
    _, ref = generate(model_dir)
    with caplog.at_level(logging.INFO, logger="llmkit.engine.loop.core_builder"):
        llm, outs = generate(model_dir, "scheduler=slo", "slo.tpot_ms=0.001",
                             "slo.ttft_ms=60000")
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    assert any("scheduler=slo: predicting step times with" in r.getMessage()
               for r in caplog.records)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_offline_rejection_is_a_finished_output_with_the_reason(tiny_model_dir):
    _, outs = generate(tiny_model_dir("llama"), "scheduler=slo", "slo.ttft_ms=0.001",
                       "scheduler.slo_admission=reject")
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "abort" and c.token_ids == []
        assert str(c.stop_reason).startswith("slo_rejected: predicted TTFT"), c.stop_reason


def test_unknown_cost_profile_names_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"scheduler\.cost_profile.*no-such-profile"):
        LLM(str(tiny_model_dir("llama")), dtype="float32",
            overrides=["scheduler=slo", "slo.tpot_ms=50",
                       "scheduler.cost_profile=no-such-profile"])
