"""A model's sampling defaults (vLLM's ``generation_config``): where they come from
(``model.generation_config=auto|vllm|PATH``), how the server's requests and ``LLM`` with
``sampling_params=None`` use them. The served end-to-end check is in test_server_limits.py."""
from __future__ import annotations

import json

import pytest

from llmkit.config.compose import build_config
from llmkit.config.errors import ConfigError
from llmkit.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmkit.entrypoints.openai.sampling import to_sampling_params
from llmkit.models.generation_config import default_sampling_fields, describe_defaults


def model_config(tmp_path, **model):
    (tmp_path / "config.json").write_text("{}")
    return build_config(str(tmp_path), groups={"model": model} if model else None).model


def test_auto_reads_the_folders_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300,
         "do_sample": True, "eos_token_id": [1, 2], "repetition_penalty": None}))
    cfg = model_config(tmp_path)
    fields = default_sampling_fields(cfg, tmp_path)
    # vLLM's fields only, max_new_tokens under SamplingParams' name; nulls are not defaults
    assert fields == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert "temperature=0.6" in describe_defaults(cfg, fields)


def test_vllm_means_none_and_a_path_means_that_file(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"min_p": 0.1, "repetition_penalty": 1.1}))
    assert default_sampling_fields(model_config(model_dir, generation_config="vllm"),
                                   model_dir) == {}
    assert "SamplingParams' own" in describe_defaults(
        model_config(model_dir, generation_config="vllm"), {})
    assert default_sampling_fields(model_config(model_dir, generation_config=str(other)),
                                   model_dir) == {"min_p": 0.1, "repetition_penalty": 1.1}
    # a folder: its generation_config.json
    assert default_sampling_fields(model_config(model_dir, generation_config=str(model_dir)),
                                   None) == {"temperature": 0.6}


def test_bad_generation_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.generation_config: got '.*nowhere'; "
                                          r"allowed: auto, vllm, or a folder"):
        default_sampling_fields(model_config(tmp_path,
                                             generation_config=str(tmp_path / "nowhere")),
                                tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ConfigError, match="not usable: SamplingParams.top_p"):
        default_sampling_fields(model_config(tmp_path, generation_config=str(bad)), tmp_path)
    with pytest.raises(ConfigError, match=r"model\.generation_defaults\.temperature"):
        model_config(tmp_path, generation_defaults={"temperature": -1})


def test_preset_states_smollm2_recommended_defaults():
    """The GGUF has no generation_config.json: the preset states its authors' values
    (model.generation_defaults), which generation_config=vllm turns off."""
    cfg = build_config("smollm2-135m-instruct").model
    fields = default_sampling_fields(cfg, None)
    assert fields == {"temperature": 0.2, "top_p": 0.9}
    cfg = build_config("smollm2-135m-instruct", overrides=["model.generation_config=vllm"]).model
    assert default_sampling_fields(cfg, None) == {}


def test_server_requests_take_defaults_only_where_unset():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 5, "max_tokens": 100}
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = to_sampling_params(unset, max_tokens=None, logprobs=None, vocab_size=100,
                           defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, 5, 100)
    given = CompletionRequest(prompt="hi", temperature=0.0, top_p=1.0, top_k=0, max_tokens=300)
    p = to_sampling_params(given, max_tokens=300, logprobs=None, vocab_size=100,
                           defaults=defaults)
    # what the request sets stays; the model's max_tokens caps the request's (vLLM's rule)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 1.0, 0, 100)
    p = to_sampling_params(given, max_tokens=30, logprobs=None, vocab_size=100,
                           defaults=defaults)
    assert p.max_tokens == 30
    # no defaults: SamplingParams' own
    p = to_sampling_params(unset, max_tokens=None, logprobs=None, vocab_size=100)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, None)


def test_llm_none_means_the_models_defaults(tiny_model_dir, tmp_path):
    """``generate(prompts)`` samples with the model's defaults; an explicit SamplingParams is
    taken as given (vLLM's rule). top_k=1 + max_new_tokens=5 make the difference visible."""
    from llmkit import LLM, SamplingParams

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"top_k": 1, "max_new_tokens": 5}))
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache={"num_blocks": 64},
              overrides=[f"model.generation_config={gen}"])
    try:
        assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=5)
        prompt = "The quick brown fox"
        greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5,
                                                     ignore_eos=True), use_tqdm=False)
        by_default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
        assert by_default.token_ids == greedy[0].outputs[0].token_ids[:len(by_default.token_ids)]
        assert len(by_default.token_ids) <= 5
        streamed = [t for out in llm.stream(prompt) for t in out.outputs[0].token_ids]
        assert streamed == by_default.token_ids
        # explicit params: SamplingParams' max_tokens=16, no top_k
        explicit = llm.generate(prompt, SamplingParams(ignore_eos=True, seed=3),
                                use_tqdm=False)[0].outputs[0]
        assert len(explicit.token_ids) == 16
    finally:
        llm.shutdown()
