"""LoRA under tensor parallel (multiproc, TP=2): every rank holds its slice of each adapter,
cut like its base layer (column-parallel: B's output rows; row-parallel: A's input columns,
the partial delta joining the all-reduce; the vocab-parallel LM head's rows, padded), so greedy
tokens with adapters equal the single-process engine's with the same adapters."""
from __future__ import annotations

import pytest

from helpers.lora_adapters import ALL_LINEAR, build_adapter

from llmkit import LLM, LoRARequest, SamplingParams
from llmkit.lora.base import LoRALoadError

PROMPTS = [[5, 9, 33, 2, 71, 8], [17, 40, 41, 42, 43], [100, 200, 300, 100, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LORA = {"enabled": True, "max_loras": 2, "max_lora_rank": 16}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _tokens(path, adapters, **groups) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", lora=LORA, **groups)
    try:
        loras = [None] + [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
        batch = [(p, lr) for lr in loras for p in PROMPTS]
        outs = llm.generate([p for p, _ in batch], GREEDY,
                            lora_request=[lr for _, lr in batch], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_adapters_equal_the_single_process_engine(arch, tiny_model_dir,
                                                                  tmp_path):
    model_dir = tiny_model_dir(arch)
    # on llama (untied) the second adapts the embedding and the LM head too
    extra = ("embed_tokens", "lm_head") if arch == "llama" else ()
    adapters = [build_adapter(model_dir, tmp_path / "r8", r=8, lora_alpha=16, seed=1),
                build_adapter(model_dir, tmp_path / "r16", r=16, lora_alpha=8, seed=2,
                              target_modules=ALL_LINEAR + extra)]
    want = _tokens(model_dir, adapters)
    n = len(PROMPTS)
    assert want[n:2 * n] != want[:n] and want[2 * n:] != want[:n]  # the adapters matter
    assert _tokens(model_dir, adapters, parallel={"tensor_parallel_size": 2}) == want


def test_a_bad_adapter_is_refused_and_the_ranks_serve_on(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    good = build_adapter(model_dir, tmp_path / "good", r=8, lora_alpha=16, seed=1)
    llm = LLM(str(model_dir), dtype="float32", lora=LORA, parallel={"tensor_parallel_size": 2})
    try:
        with pytest.raises(LoRALoadError):
            llm.engine.add_lora(LoRARequest("missing", 1, str(tmp_path / "nowhere")))
        lr = LoRARequest("good", 2, str(good))
        assert llm.engine.add_lora(lr)
        out = llm.generate(PROMPTS[:1], GREEDY, lora_request=lr, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
        assert llm.engine.remove_lora(2)
    finally:
        llm.engine.shutdown()
