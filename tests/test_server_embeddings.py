"""``/v1/embeddings`` through the official ``openai`` client against a pooling server (a tiny
Qwen3 with ``model.runner=pooling`` declaring Matryoshka dimensions): base64 (the client's
default) and float, texts and token ids, ``dimensions``, usage, and the 400s; embeddings
checked against transformers' hidden states (cosine >= 0.9999)."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from helpers.pooling_reference import reference_embeddings
from helpers.server_process import SERVER_THREADS, ServerProcess

TEXTS = ["Hello there, how are you?", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    src = tiny_model_dir("qwen3")
    dst = tmp_path_factory.mktemp("matryoshka") / "m"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(model_dir, "model.runner=pooling", "kv_cache.num_blocks=256",
                       "scheduler.max_num_batched_tokens=8", SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def want(model_dir, tiny_tokenizer):
    ids = [tiny_tokenizer.encode(t) for t in TEXTS]
    return ids, reference_embeddings(model_dir, ids, "LAST", normalize=True)


def _close(got, w: torch.Tensor) -> None:
    g = torch.tensor(list(got), dtype=torch.float32)
    assert g.shape == w.shape
    assert torch.nn.functional.cosine_similarity(g, w, dim=0).item() >= 0.9999


def test_texts_base64_and_float(server, want):
    ids, ref = want
    client = server.client()
    model = client.models.list().data[0].id
    out = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1]
    for d, w in zip(out.data, ref):
        _close(d.embedding, w)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    _close(floats.data[0].embedding, ref[0])
    raw = httpx.post(server.url("/v1/embeddings"),
                     json={"input": TEXTS[1], "encoding_format": "base64"}).json()

    _close(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4"), ref[1])
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"


def test_token_ids_and_dimensions(server, want):
    ids, ref = want
    client = server.client()
    one = client.embeddings.create(model=client.models.list().data[0].id,
                                   input=ids[0], encoding_format="float")
    _close(one.data[0].embedding, ref[0])
    both = client.embeddings.create(model=client.models.list().data[0].id, input=ids)
    for d, w in zip(both.data, ref):
        _close(d.embedding, w)
    short = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS,
                                     dimensions=16)
    for d, w in zip(short.data, ref):
        assert len(d.embedding) == 16
        _close(d.embedding, torch.nn.functional.normalize(w[:16], dim=0))
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 20}, "dimensions"),  # not one of [16, 32]
    ({"input": [1, 10 ** 6]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1], []]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    resp = httpx.post(server.url("/v1/embeddings"), json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_generation_on_a_pooling_server_is_400_naming_model_runner(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=server.client().models.list().data[0].id,
                                           prompt="hi", max_tokens=2)
    assert "model.runner" in str(e.value)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_chat_and_responses_on_a_pooling_server_are_400(server, path, body):
    resp = httpx.post(server.url(path), json=body)
    assert resp.status_code == 400, resp.text
    assert "model.runner" in resp.json()["error"]["message"]


def test_bert_server_embeds_and_refuses_an_input_longer_than_one_step(tiny_tokenizer,
                                                                      tmp_path_factory):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bert")
    BertModel(BertConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(str(out))
    tiny_tokenizer.save_pretrained(str(out))
    ids = tiny_tokenizer.encode(TEXTS[1])
    with ServerProcess(out, "scheduler.max_num_batched_tokens=16", SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("bert-server") / "server.log") as srv:
        client = srv.client()
        r = client.embeddings.create(model=client.models.list().data[0].id, input=[ids[:16]])
        _close(r.data[0].embedding,
               reference_embeddings(out, [ids[:16]], "CLS", normalize=True)[0])
        resp = httpx.post(srv.url("/v1/embeddings"), json={"input": ids})
        assert resp.status_code == 400
        assert "scheduler.max_num_batched_tokens" in resp.json()["error"]["message"]
        assert len(ids) > 16
