"""``/v1/completions`` with ``use_beam_search`` through the official ``openai`` client
(``extra_body``): ``n`` beams per prompt, best first, equal to Hugging Face's
``generate(num_beams=n)`` with ``ignore_eos``; fields beam search cannot honour are 400s naming
the field (httpx for the raw bodies)."""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.server_process import SERVER_THREADS, ServerProcess, error_body

PROMPTS = [[17, 250, 31, 402, 88, 9, 150, 77, 300, 12, 45], [520, 61, 7, 333, 90]]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("llama")
    with ServerProcess(model_dir, "kv_cache.block_size=8", "kv_cache.num_blocks=256",
                       SERVER_THREADS,
                       log_path=tmp_path_factory.mktemp("server") / "server.log") as srv:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        yield srv, hf, tok, srv.client().models.list().data[0].id


def hf_texts(hf, tok, prompt: list[int], k: int, length_penalty: float) -> list[str]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long),
                          num_beams=k, num_return_sequences=k, do_sample=False,
                          max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                          early_stopping=False, eos_token_id=None, pad_token_id=0)
    return [tok.decode(seq[len(prompt):], skip_special_tokens=True) for seq in out.tolist()]


def test_beams_through_the_openai_client_equal_hf(env):
    srv, hf, tok, model = env
    k = 3
    resp = srv.client().completions.create(
        model=model, prompt=PROMPTS, n=k, max_tokens=MAX_TOKENS, logprobs=2,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5})
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS) * k))
    for p, prompt in enumerate(PROMPTS):
        choices = resp.choices[p * k:(p + 1) * k]
        assert [c.text for c in choices] == hf_texts(hf, tok, prompt, k, 0.5)
        for c in choices:
            assert c.finish_reason == "length"
            assert len(c.logprobs.tokens) == MAX_TOKENS
            assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    assert resp.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert resp.usage.completion_tokens == len(PROMPTS) * k * MAX_TOKENS
    # one prompt as text, width 1 (greedy)
    one = srv.client().completions.create(model=model, prompt=tok.decode(PROMPTS[1]), n=1,
                                          max_tokens=MAX_TOKENS,
                                          extra_body={"use_beam_search": True,
                                                      "ignore_eos": True})
    ids = tok.encode(tok.decode(PROMPTS[1]))
    assert [c.text for c in one.choices] == hf_texts(hf, tok, ids, 1, 1.0)


def test_beams_share_the_prompts_blocks_on_the_server(env):
    srv, _, _, model = env
    prompt, k = list(range(100, 120)), 3  # two full blocks of 8
    before = srv.metrics()["llmkit:prefix_cache_hits_total"]
    srv.client().completions.create(model=model, prompt=prompt, n=k, max_tokens=MAX_TOKENS,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    hits = srv.metrics()["llmkit:prefix_cache_hits_total"] - before
    num_requests = 1 + (MAX_TOKENS - 1) * k  # one, then k per step
    assert hits >= (num_requests - 1) * 16


def test_streamed_each_beam_is_one_chunk_at_the_end(env):
    srv, _, _, model = env
    kwargs = dict(model=model, prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS,
                  extra_body={"use_beam_search": True, "ignore_eos": True})
    whole = srv.client().completions.create(**kwargs)
    chunks = list(srv.client().completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason)
            for c in chunks[:-1]] == [(c.index, c.text, c.finish_reason) for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens)


@pytest.mark.parametrize("extra,param", [
    ({"n": 0}, "n"),
    ({"n": 11}, "n"),
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logprobs": 5}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"max_tokens": 10_000}, "max_tokens"),
])
def test_incompatible_fields_are_400s_naming_the_field(env, extra, param):
    srv, _, _, model = env
    body = {"model": model, "prompt": PROMPTS[0], "n": 2, "max_tokens": 3,
            "use_beam_search": True, **extra}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert error_body(r)["param"] == param


def test_chat_with_use_beam_search_is_a_400(env):
    srv, _, _, model = env
    r = httpx.post(srv.url("/v1/chat/completions"), timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "n": 2,
        "use_beam_search": True})
    assert r.status_code == 400 and error_body(r)["param"] == "use_beam_search"
    assert "Traceback" not in srv.log()


def test_generated_beam_search_bodies_get_200_or_an_openai_400(env):
    """The fields beam search reads, generated (hypothesis): never a 5xx, every error in
    OpenAI's shape naming a field, every 200 with ``n`` choices per prompt."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from server_fuzz import openai_error_problem

    srv, _, _, model = env
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 14),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3))
    body_st = st.fixed_dictionaries(
        {"model": st.just(model), "use_beam_search": st.just(True),
         "prompt": st.sampled_from([PROMPTS[1], "Hello", PROMPTS, [[5], [6, 7]]])},
        optional={"n": values,
                  # not None: a search up to the model's context takes long
                  "max_tokens": st.one_of(st.integers(-1, 6), st.text(max_size=2),
                                          st.floats(allow_nan=False, allow_infinity=False)),
                  "length_penalty": values, "temperature": values, "ignore_eos": values,
                  "logprobs": values, "include_stop_str_in_output": values,
                  "best_of": values, "top_k": values})

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=body_st)
    def check(body):
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=120)
        assert r.status_code in (200, 400), (r.status_code, r.text, body)
        assert openai_error_problem(r.status_code, r.headers["content-type"], r.content) is None
        if r.status_code == 400:
            assert r.json()["error"]["param"], body
        else:
            num_prompts = len(body["prompt"]) if isinstance(body["prompt"][0], list) else 1
            assert len(r.json()["choices"]) == num_prompts * body.get("n", 1)

    check()
    assert "Traceback" not in srv.log()
