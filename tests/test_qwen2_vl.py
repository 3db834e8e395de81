"""Qwen2-VL and Qwen2.5-VL (issue 23): tiny random models against Hugging Face's — images of
different sizes (their number of tokens follows), M-RoPE positions across chunked prefill,
preemption and prefix hits — the encoder cache, image hashes in block hashes, and the server."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llmkit import LLM, SamplingParams
from helpers.tiny_qwen2_vl import IMAGE, IMAGE_PAD, build_qwen2_vl_dir, hf_processor

MAX_TOKENS = 10
VARIANTS = ("qwen2_vl", "qwen2_5_vl")


def make_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {v: build_qwen2_vl_dir(tmp_path_factory.mktemp(f"tiny-{v}"), variant=v)
            for v in VARIANTS}


@pytest.fixture(scope="module")
def hf_reference(model_dirs):
    """``(variant, text, images) -> (prompt ids, greedy ids)`` from transformers' model and
    processor (memoised: each setup compares with the same references)."""
    import transformers

    models, processors, memo = {}, {}, {}

    def run(variant: str, text: str, images: list[Image.Image]):
        key = (variant, text, tuple(im.tobytes() + bytes(im.size) for im in images))
        if key in memo:
            return memo[key]
        if variant not in models:
            prefix = "Qwen2VL" if variant == "qwen2_vl" else "Qwen2_5_VL"
            cls = getattr(transformers, f"{prefix}ForConditionalGeneration")
            models[variant] = cls.from_pretrained(str(model_dirs[variant]),
                                                  dtype=torch.float32).eval()
            processors[variant] = hf_processor(model_dirs[variant])
        proc = processors[variant]
        inputs = proc(text=[text], images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = models[variant].generate(**inputs, max_new_tokens=MAX_TOKENS,
                                           min_new_tokens=MAX_TOKENS, do_sample=False)
        n = inputs["input_ids"].shape[1]
        memo[key] = inputs["input_ids"][0].tolist(), out[0, n:].tolist()
        return memo[key]

    return run


PROMPTS = [
    (f"Describe {IMAGE} in a few words.", [make_image(1)]),  # 56x42 px: 12 tokens
    ("The capital of France is", []),
    # 28x70 px (10 tokens) and 90x120 px, resized to max_pixels (42x56: 12 tokens)
    (f"{IMAGE} and {IMAGE}: what differs?", [make_image(2, (64, 30)), make_image(3, (120, 90))]),
    (f"Once upon a time {IMAGE}", [make_image(4, (30, 30))]),  # the prompt ends in an image
    (f"{IMAGE} then {IMAGE} again", [make_image(1), make_image(1)]),  # encoded once
]


def _prompt(text: str, images: list[Image.Image]):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


SETUPS = {
    "whole": {},
    # chunks of 5 tokens: images and M-RoPE tables are cut mid-way, several requests per step
    "chunked": {"scheduler": {"max_num_batched_tokens": 5}},
    # a tiny KV pool: requests are preempted and their positions computed again
    "preempted": {"scheduler": {"max_num_batched_tokens": 16},
                  "kv_cache": {"num_blocks": 12, "block_size": 4}},
}


@pytest.mark.parametrize("variant, setup", [
    ("qwen2_vl", "whole"), ("qwen2_vl", "chunked"), ("qwen2_vl", "preempted"),
    ("qwen2_5_vl", "whole"), ("qwen2_5_vl", "preempted"),
])
def test_greedy_matches_hf(model_dirs, hf_reference, variant, setup):
    llm = LLM(str(model_dirs[variant]), dtype="float32", **SETUPS[setup])
    outs = llm.generate([_prompt(t, ims) for t, ims in PROMPTS], _greedy(), use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ref_prompt, ref_tokens = hf_reference(variant, text, images)
        # The image tokens (as many as the image's size gives) are prompt tokens: HF's.
        assert out.prompt_token_ids == ref_prompt, text
        assert list(out.outputs[0].token_ids) == ref_tokens, text
    stats = llm.engine.scheduler.stats()
    assert stats.encoder_cache.num_encoder_runs >= 4
    if setup == "preempted":
        assert stats.num_preemptions_total > 0, "the KV pool was meant to force preemption"


def test_image_tokens_follow_the_image_size(model_dirs):
    # An encoder cache of 12 tokens: an image of 16 is refused before the engine sees it.
    llm = LLM(str(model_dirs["qwen2_vl"]), dtype="float32",
              scheduler={"encoder_cache_size": 12})
    mm = llm.frontend.mm_processor
    sizes = {(40, 52): 12, (64, 30): 10, (120, 90): 12, (30, 30): 4, (14, 14): 4}
    pad = llm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for (w, h), n in sizes.items():
        image = make_image(0, (w, h))
        assert mm.num_tokens(image) == n, (w, h)
        out = llm.generate(_prompt(f"a {IMAGE}", [image]), SamplingParams(max_tokens=1),
                           use_tqdm=False)[0]
        assert out.prompt_token_ids.count(pad) == n
    big = make_image(0, (56, 56))
    assert mm.num_tokens(big) == 16
    with pytest.raises(ValueError, match="encoder_cache_size"):
        llm.generate(_prompt(f"a {IMAGE}", [big]), use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(_prompt("no image here", [make_image(0)]), use_tqdm=False)
    assert llm.generate(_prompt(f"a {IMAGE}", [make_image(0)]), SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_mrope_positions_match_hf_rope_index(model_dirs):
    """The runner's prompt positions and delta are transformers' ``get_rope_index``."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration

    from llmkit.models.qwen2_vl import mrope_input_positions
    from llmkit.multimodal.processor import multimodal_processor_for

    path = model_dirs["qwen2_vl"]
    config = AutoConfig.from_pretrained(str(path))
    mm = multimodal_processor_for(path, config, AutoTokenizer.from_pretrained(str(path)), 4)
    text, images = PROMPTS[2]
    proc = hf_processor(path)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    ids, features = mm.process(proc.tokenizer.encode(text), images)
    assert ids == inputs["input_ids"][0].tolist()
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    ref, ref_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
    pos, delta = mrope_input_positions(len(ids), features, 2)
    np.testing.assert_array_equal(pos, ref[:, 0].numpy())
    assert delta == int(ref_delta[0, 0]) < 0


def test_repeated_image_is_encoded_once_and_shares_blocks(model_dirs):
    llm = LLM(str(model_dirs["qwen2_5_vl"]), dtype="float32", kv_cache={"block_size": 4})
    text = f"Look at {IMAGE} and say what you see in it please."
    image, other = make_image(7), make_image(8)
    first = llm.generate(_prompt(text, [image]), _greedy(), use_tqdm=False)[0]
    # The same pixels again: the whole prompt's full blocks are shared, and decoding from the
    # cached prefix continues the M-RoPE positions as computing it did.
    again = llm.generate(_prompt(text, [image.copy()]), _greedy(), use_tqdm=False)[0]
    n_prompt = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n_prompt - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.engine.scheduler.stats().encoder_cache
    assert stats.num_encoder_runs == 1 and llm.engine.executor.runner.mm.num_encoder_runs == 1
    # Same text, another image: only the blocks before the image's first token are shared.
    pad = llm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    image_start = first.prompt_token_ids.index(pad)
    diff = llm.generate(_prompt(text, [other]), _greedy(), use_tqdm=False)[0]
    assert diff.num_cached_tokens == image_start // 4 * 4
    assert llm.engine.scheduler.stats().encoder_cache.num_encoder_runs == 2
    assert diff.outputs[0].token_ids != first.outputs[0].token_ids


def test_prefix_hit_inside_an_image_matches_hf(model_dirs, hf_reference):
    """A cached prefix that ends inside an image: the rest of its tokens take their slice of
    the cached encoder output and of the prompt's M-RoPE table."""
    llm = LLM(str(model_dirs["qwen2_vl"]), dtype="float32", kv_cache={"block_size": 4})
    image = make_image(61)
    first_text, second_text = f"Hi {IMAGE} a cat", f"Hi {IMAGE} the sea"
    llm.generate(_prompt(first_text, [image]), _greedy(), use_tqdm=False)
    out = llm.generate(_prompt(second_text, [image]), _greedy(), use_tqdm=False)[0]
    pad = llm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = out.prompt_token_ids
    start, end = ids.index(pad), len(ids) - ids[::-1].index(pad)
    assert start < out.num_cached_tokens <= end, (start, out.num_cached_tokens, end)
    ref_prompt, ref_tokens = hf_reference("qwen2_vl", second_text, [image])
    assert ids == ref_prompt and list(out.outputs[0].token_ids) == ref_tokens


def test_chat_content_parts_use_the_vision_placeholder(model_dirs, hf_reference):
    import base64
    import io

    llm = LLM(str(model_dirs["qwen2_vl"]), dtype="float32")
    image = make_image(21)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "?"}]}]
    out = llm.chat(msgs, _greedy(), use_tqdm=False)[0]
    text = hf_processor(model_dirs["qwen2_vl"]).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                      {"type": "image"}, {"type": "text", "text": "?"}]}],
        add_generation_prompt=True)
    ref_prompt, ref_tokens = hf_reference("qwen2_vl", text, [image])
    assert out.prompt_token_ids == ref_prompt
    assert list(out.outputs[0].token_ids) == ref_tokens


def test_server_chat_with_data_url_images_matches_hf(model_dirs, hf_reference, tmp_path):
    """Images of two sizes as data URLs through the official ``openai`` client: HF's tokens
    and prompt token count (its image tokens included)."""
    import base64
    import io

    import httpx
    from helpers.server_process import SERVER_THREADS, ServerProcess

    def data_url(image: Image.Image) -> str:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    path = model_dirs["qwen2_5_vl"]
    images = [make_image(71, (64, 30)), make_image(72, (120, 90))]
    messages = [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
        {"type": "text", "text": "What differs?"}]}]
    text = hf_processor(path).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "What differs?"}]}],
        add_generation_prompt=True)
    ref_prompt, ref_tokens = hf_reference("qwen2_5_vl", text, images)
    offline = LLM(str(path), dtype="float32").chat(messages, _greedy(), use_tqdm=False)[0]
    assert offline.prompt_token_ids == ref_prompt
    assert list(offline.outputs[0].token_ids) == ref_tokens
    server = ServerProcess(path, SERVER_THREADS, log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        client = server.client()
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(model=model, messages=messages,
                                              max_tokens=MAX_TOKENS, temperature=0.0,
                                              extra_body={"min_tokens": MAX_TOKENS})
        # /tokenize counts the images' tokens of chat content parts as the engine sees them.
        tokenized = httpx.post(server.url("/tokenize"),
                               json={"model": model, "messages": messages}, timeout=60).json()
    finally:
        server.stop()
    assert resp.choices[0].message.content == offline.outputs[0].text
    # The images' tokens are prompt tokens.
    assert resp.usage.prompt_tokens == len(ref_prompt)
    assert tokenized["tokens"] == ref_prompt and tokenized["count"] == len(ref_prompt)


def test_decode_steps_take_one_position_row(model_dirs):
    """Past its prompt a request's 3 M-RoPE rows are equal (``index + delta``): decode steps
    hand the model one row, as for text models, which is what step graphs capture."""
    llm = LLM(str(model_dirs["qwen2_vl"]), dtype="float32")
    seen: list[tuple[int, int]] = []  # (tokens, position rows) per forward
    model = llm.engine.executor.runner.model
    hook = model.register_forward_pre_hook(
        lambda _, args: seen.append((args[1].shape[-1], args[1].dim())))
    try:
        text, images = PROMPTS[0]
        out = llm.generate([_prompt(text, images), "The capital of France is"], _greedy(4),
                           use_tqdm=False)[0]
    finally:
        hook.remove()
    assert seen[0] == (len(out.prompt_token_ids) + len(llm.tokenizer.encode(
        "The capital of France is")), 2)
    assert seen[1:] and all(rows == 1 for _, rows in seen[1:])
