"""Quantized weights end to end (``model.quantization``, ``llmkit/linear/quantized.py``).

Each format runs a tiny model through the engine with its weights kept packed, against the same
engine on the float loading path with a reference linear (``tests/helpers/quant_reference.py``)
that multiplies in float64 with the weights and activations the kernel computes with: the greedy
tokens must be equal and the chosen tokens' logprobs within float32 rounding.
"""
from __future__ import annotations

import json

import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from helpers.tiny_models import write_tiny_gguf

PROMPTS = [[5, 9, 33, 2, 71, 8], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26], [40, 41, 42]]
# K-quants need rows of whole 256-value super-blocks: every in_features a multiple of 256.
K_SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=512)
LOGPROB_ATOL = 2e-3


def run(path, prompts=PROMPTS, max_tokens=10, linear_method=None, **groups):
    overrides = [f"model.linear_method={linear_method}"] if linear_method else []
    llm = LLM(str(path), dtype="float32", platform={"native_kernels": "on"},
              overrides=overrides, **groups)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    methods = llm.engine.executor.backend_info.linear_methods
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                      zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs], methods


def assert_same_greedy(actual, expected, atol=LOGPROB_ATOL):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(actual, expected):
        assert tokens == ref_tokens
        diff = max(abs(a - b) for a, b in zip(lps, ref_lps))
        assert diff <= atol, f"chosen-token logprobs differ by {diff:.3g}"


@pytest.mark.parametrize("weight_type,type_of,shapes", [
    ("Q4_0", None, {}),
    ("Q4_1", None, {}),
    ("Q8_0", None, {}),
    ("Q4_K", None, K_SHAPES),
    ("Q6_K", None, K_SHAPES),
    # a Q4_K_M-like file: v and down in Q6_K (q|k|v then packs shard by shard)
    ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, K_SHAPES),
])
def test_tiny_gguf_kept_quantized_matches_reference(weight_type, type_of, shapes,
                                                    tiny_model_dir, tmp_path):
    arch = "mistral"  # tied embedding (the LM head multiplies with the packed embedding)
    path = write_tiny_gguf(tiny_model_dir(arch, **shapes), tmp_path / "m.gguf", weight_type,
                           type_of)
    kept, methods = run(path)
    formats = {weight_type.lower(), *(t.lower() for t in (type_of or {}).values())}
    assert methods and all(m.startswith("quantized:") for m in methods), methods
    assert {f for m in methods for f in m.split(":")[1].split("+")} == formats
    ref, ref_methods = run(path, quantization="none",
                           linear_method="helpers.quant_reference.GGUFReference")
    assert ref_methods == ("gguf-reference",)
    assert_same_greedy(kept, ref)


def test_untied_head_and_biases_kept_quantized(tiny_model_dir, tmp_path):
    """qwen2: q/k/v biases beside the packed weights, an untied output matrix."""
    path = write_tiny_gguf(tiny_model_dir("qwen2", tie_word_embeddings=False),
                           tmp_path / "m.gguf", "Q8_0")
    kept, _ = run(path)
    ref, _ = run(path, quantization="none",
                 linear_method="helpers.quant_reference.GGUFReference")
    assert_same_greedy(kept, ref)


@pytest.mark.parametrize("mode,reference", [("int8", "Int8Reference"),
                                            ("fp8", "Fp8Reference")])
def test_float_folder_quantized_per_channel(mode, reference, tiny_model_dir):
    path = tiny_model_dir("llama")
    kept, methods = run(path, quantization=mode)
    assert f"quantized:{mode}" in methods
    assert any(not m.startswith("quantized") for m in methods)  # the LM head stays float
    ref, _ = run(path, quantization="none",
                 linear_method=f"helpers.quant_reference.{reference}")
    assert_same_greedy(kept, ref)


def test_other_gguf_types_dequantize_with_a_notice(tiny_model_dir, tmp_path, caplog):
    """A type the kernels do not keep (Q5_0 here) is dequantized, once noticed; the layers
    run on the float method while the kept ones stay packed."""
    path = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "Q8_0",
                           {"attn_q": "Q5_0"})
    with caplog.at_level("WARNING"):
        _, methods = run(path, max_tokens=2)
    notices = [r for r in caplog.records if "Q5_0 tensors are dequantized" in r.getMessage()]
    assert len(notices) == 1
    assert "quantized:q8_0" in methods and any("float in gguf" in m for m in methods)


def prompt_logprobs(path, text_ids, linear_method=None, **groups):
    overrides = [f"model.linear_method={linear_method}"] if linear_method else []
    llm = LLM(str(path), dtype="float32", overrides=overrides, **groups)
    [out] = llm.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    lps = torch.tensor([lp[t].logprob for t, lp in zip(text_ids[1:], out.prompt_logprobs[1:])])
    return lps, llm.engine.executor.backend_info.linear_methods


def test_default_model_q4_1_kept_matches_reference(smollm2_gguf):
    """The shipped SmolLM2 (Q4_1 matrices, a tied Q8_0 embedding) with its blocks kept, against
    the dequantized weights with the kernel's activation handling in float64, teacher-forced
    over a text. Not bit-equal: 30 layers re-quantize their activations to 8 bits, and an input
    within an ulp of a rounding boundary goes either way with the order of float32 sums; the
    same reference summed in float32 moves as far. The bound: the kernels are no farther from
    the float64 reference than that float32 summation is (measured: mean |d logprob| ~0.03)."""
    from llmkit.models.loader.gguf import load_gguf_tokenizer

    text = ("The sun rises in the east and sets in the west. Water boils at one hundred "
            "degrees and freezes at zero. A byte holds eight bits, and a computer stores "
            "numbers as bytes. Tokens are pieces of words.")
    ids = load_gguf_tokenizer(smollm2_gguf)(text)["input_ids"]
    kept, methods = prompt_logprobs(smollm2_gguf, ids)
    assert set(methods) == {"quantized:q4_1", "quantized:q8_0"}
    ref64, _ = prompt_logprobs(smollm2_gguf, ids, "helpers.quant_reference.GGUFReference",
                               quantization="none")
    ref32, _ = prompt_logprobs(smollm2_gguf, ids, "helpers.quant_reference.GGUFReference32",
                               quantization="none")
    d_kept, d_32 = (kept - ref64).abs(), (ref32 - ref64).abs()
    assert d_kept.mean() <= 2 * d_32.mean() + 1e-3, (d_kept.mean(), d_32.mean())
    assert d_kept.max() <= max(2 * d_32.max(), 0.05), (d_kept.max(), d_32.max())


def test_unsupported_hf_quantization_fails_naming_the_format(tiny_model_dir, tmp_path):
    import shutil
    folder = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    for q in ("auto", "none", "int8"):
        with pytest.raises(ConfigError, match="quantized with 'gptq'"):
            LLM(str(folder), quantization=q)


def test_quantization_errors_name_the_key(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.quantization"):
        LLM(str(tiny_model_dir("llama")), quantization="gguf")  # not a GGUF
    with pytest.raises(ConfigError, match="model.quantization"):
        LLM(str(tiny_model_dir("llama")), quantization="int8",
            overrides=["model.linear_method=torch"])
    with pytest.raises(ConfigError, match="model.quantization"):
        LLM(str(tiny_model_dir("llama")), quantization="nf4")
    path = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "Q8_0")
    # auto with a forced float method dequantizes (with a warning) instead of failing
    _, methods = run(path, max_tokens=2, linear_method="torch")
    assert methods == ("torch",)


def test_packed_embedding_lookup_reads_the_gguf_rows(tiny_model_dir, tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    path = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "Q4_1")
    llm = LLM(str(path), dtype="float32")
    model = llm.engine.executor.runner.model
    emb = model.model.embed_tokens
    assert emb.packed is not None and emb.weight.numel() == 0  # no dense copy kept
    [t] = [t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
    ids = torch.tensor([0, 7, 3, 7, 600])
    expected = torch.from_numpy(dequantize(t.data, GGMLQuantizationType.Q4_1))[ids]
    assert torch.equal(emb(ids), expected)
