"""Pooling engines (model.runner=pooling): LLM.embed against transformers' hidden states pooled
the same way (float32, cosine >= 0.9999), over chunked prefills and prefix-cache hits, with the
pooling read from sentence-transformers files or the architecture's default."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.pooling_reference import reference_embeddings
from llmkit import LLM, SamplingParams

PROMPTS = ["Hello there, how are you doing today?",
           "The quick brown fox jumps over the lazy dog, " * 3,
           "a"]


def _reference(model_dir: Path, tokenizer, prompts: list[str], kind: str,
               normalize: bool) -> list[torch.Tensor]:
    return reference_embeddings(model_dir, [tokenizer.encode(p) for p in prompts], kind,
                                normalize)


def _assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = torch.tensor(g.outputs.embedding)
        assert g.shape == w.shape
        cos = torch.nn.functional.cosine_similarity(g, w, dim=0).item()
        assert cos >= 0.9999, cos
        assert torch.allclose(g, w, rtol=1e-3, atol=1e-4), (g - w).abs().max()


def _with_sentence_transformers(src: Path, dst: Path, mode: str, normalize: bool) -> Path:
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == mode
             for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               **flags}))
    return dst


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


def test_last_token_default_matches_transformers_chunked_and_cached(qwen3_dir, tiny_tokenizer):
    # a 6-token step budget cuts the long prompt into chunks; the repeat hits the prefix cache
    llm = LLM(str(qwen3_dir), dtype="float32", overrides=["model.runner=pooling"],
              scheduler={"max_num_batched_tokens": 6})
    want = _reference(qwen3_dir, tiny_tokenizer, PROMPTS, "LAST", normalize=True)
    _assert_close(llm.embed(PROMPTS, use_tqdm=False), want)
    again = llm.embed(PROMPTS[1], use_tqdm=False)
    assert again[0].num_cached_tokens > 0  # last-token pooling keeps prefix caching
    _assert_close(again, want[1:2])
    # token ids are prompts too
    ids = tiny_tokenizer.encode(PROMPTS[0])
    _assert_close(llm.embed([ids], use_tqdm=False), want[:1])
    with pytest.raises(ValueError, match="model.runner"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("mode,kind,normalize", [("mean_tokens", "MEAN", False),
                                                 ("cls_token", "CLS", True)])
def test_sentence_transformers_pooling_matches_transformers(qwen3_dir, tiny_tokenizer,
                                                            tmp_path, mode, kind, normalize):
    folder = _with_sentence_transformers(qwen3_dir, tmp_path / "st", mode, normalize)
    llm = LLM(str(folder), dtype="float32", overrides=["model.runner=pooling"],
              scheduler={"max_num_batched_tokens": 6})
    want = _reference(qwen3_dir, tiny_tokenizer, PROMPTS, kind, normalize)
    _assert_close(llm.embed(PROMPTS, use_tqdm=False), want)
    again = llm.embed(PROMPTS[1], use_tqdm=False)  # no prefix hit may skip a token's state
    assert again[0].num_cached_tokens == 0
    _assert_close(again, want[1:2])
    llm.shutdown()


def test_embed_on_a_generating_engine_names_model_runner(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32")  # auto: *ForCausalLM generates
    with pytest.raises(ValueError, match="model.runner"):
        llm.embed("hello", use_tqdm=False)
    llm.shutdown()


def test_bare_qwen3_model_checkpoint_pools_by_default(qwen3_dir, tiny_tokenizer, tmp_path):
    """A checkpoint saved from AutoModel (architecture Qwen3Model: no head, no ``model.``
    prefix) is an embedding model: runner=auto pools it (last token, normalized)."""
    from transformers import AutoModel

    base = tmp_path / "qwen3model"
    AutoModel.from_pretrained(str(qwen3_dir), dtype=torch.float32).save_pretrained(str(base))
    tiny_tokenizer.save_pretrained(str(base))
    assert json.loads((base / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(base), dtype="float32")
    want = _reference(qwen3_dir, tiny_tokenizer, PROMPTS, "LAST", normalize=True)
    _assert_close(llm.embed(PROMPTS, use_tqdm=False), want)
    llm.shutdown()


@pytest.fixture(scope="module")
def bert_dir(tiny_tokenizer, tmp_path_factory):
    """A tiny random BertModel (2 layers, hidden 64) saved with the tiny tokenizer."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                     pad_token_id=tiny_tokenizer.pad_token_id)
    model = BertModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(str(out))
    tiny_tokenizer.save_pretrained(str(out))
    return out


def test_bert_encoder_matches_transformers_never_chunked(bert_dir, tiny_tokenizer, tmp_path):
    # auto: BertModel pools (CLS, normalized); prompts that do not fit the step's remaining
    # budget wait for the next step instead of being cut (bidirectional attention)
    llm = LLM(str(bert_dir), dtype="float32", scheduler={"max_num_batched_tokens": 32})
    prompts = PROMPTS[:1] + ["Pack my box with five dozen liquor jugs.", "a"]
    want = _reference(bert_dir, tiny_tokenizer, prompts, "CLS", normalize=True)
    _assert_close(llm.embed(prompts, use_tqdm=False), want)
    with pytest.raises(ValueError, match="scheduler.max_num_batched_tokens"):
        llm.embed(PROMPTS[1], use_tqdm=False)  # 52 tokens: longer than one step
    llm.shutdown()
    folder = _with_sentence_transformers(bert_dir, tmp_path / "st", "mean_tokens", True)
    llm = LLM(str(folder), dtype="float32")
    want = _reference(bert_dir, tiny_tokenizer, PROMPTS, "MEAN", normalize=True)
    _assert_close(llm.embed(PROMPTS, use_tqdm=False), want)
    llm.shutdown()
