"""Whole engines on every instruction-set tier this CPU supports (``platform.isa``): the tiers
differ in speed only, so a float32 engine over kept quantized weights (the integer dot products
that VNNI changes) and float32 layers gives the same tokens and the same logprob bits on each
tier. torch's own kernels are the same in-process, so any difference is llmkit's kernels'."""
from __future__ import annotations

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.cpu_isa import supported_tiers

TIERS = supported_tiers()
PROMPTS = [[5, 9, 33, 2, 71, 8], [17] * 20, [40, 41, 42]]


def run(model, isa: str):
    llm = LLM(str(model), dtype="float32", platform={"isa": isa},
              kv_cache={"num_blocks": 64})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    info = llm.engine.backend_info
    llm.shutdown()
    return info, [(o.outputs[0].token_ids,
                   [{t: v.logprob for t, v in lp.items()} for lp in o.outputs[0].logprobs])
                  for o in outs]


@pytest.mark.skipif(len(TIERS) < 2, reason="one tier on this CPU: nothing to compare")
@pytest.mark.parametrize("weights", ["q4_1", "q8_0"])
def test_every_tier_generates_the_same_bits(tiny_model_dir, tmp_path, weights):
    from helpers.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / f"{weights}.gguf",
                           weights.upper())
    info, best = run(path, "auto")
    assert info.isa == TIERS[-1]
    assert f"quantized:{weights}" in info.linear_methods
    for tier in TIERS[:-1]:
        tier_info, outs = run(path, tier)
        assert tier_info.isa == tier
        assert outs == best, tier
