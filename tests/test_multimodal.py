"""Images in prompts (issue 23): a tiny random LLaVA against Hugging Face's, the encoder cache,
and image hashes in the prefix cache's block hashes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llmkit import LLM, SamplingParams
from helpers.tiny_llava import IMAGE_TOKEN, NUM_IMAGE_TOKENS, build_llava_dir

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_llava_dir(tmp_path_factory.mktemp("tiny-llava"))


def make_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def hf_reference(llava_dir):
    """``(text, images) -> (prompt ids, greedy ids)`` from transformers' LLaVA and processor."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(llava_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(llava_dir),
                                                          dtype=torch.float32).eval()

    def run(text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
        if images:
            inputs = processor(text=[text], images=images, return_tensors="pt")
        else:
            inputs = processor.tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS)
        n = inputs["input_ids"].shape[1]
        return inputs["input_ids"][0].tolist(), out[0, n:].tolist()

    return run


PROMPTS = [
    (f"Describe {IMAGE_TOKEN} in a few words.", [make_image(1)]),
    ("The capital of France is", []),
    (f"{IMAGE_TOKEN} and {IMAGE_TOKEN}: what differs?", [make_image(2), make_image(3, (64, 30))]),
    (f"Once upon a time {IMAGE_TOKEN}", [make_image(4)]),
    # the same image twice in one prompt: encoded once, both placeholders filled
    (f"{IMAGE_TOKEN} then {IMAGE_TOKEN} again", [make_image(1), make_image(1)]),
]


def _prompt(text: str, images: list[Image.Image]):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("setup", [
    # whole prompts in one step
    {},
    # chunks of 7 tokens: images (16 tokens) are cut by chunks, several requests per step
    {"scheduler": {"max_num_batched_tokens": 7}},
    # a tiny KV pool: requests are preempted and recomputed (their images encoded again or
    # found in the encoder cache)
    {"scheduler": {"max_num_batched_tokens": 16}, "kv_cache": {"num_blocks": 14,
                                                               "block_size": 4}},
], ids=["whole", "chunked", "preempted"])
def test_llava_greedy_matches_hf(llava_dir, hf_reference, setup):
    llm = LLM(str(llava_dir), dtype="float32", **setup)
    outs = llm.generate([_prompt(t, ims) for t, ims in PROMPTS], _greedy(), use_tqdm=False)
    for (text, images), out in zip(PROMPTS, outs):
        ref_prompt, ref_tokens = hf_reference(text, images)
        # Image tokens count as prompt tokens: the expanded prompt is HF's.
        assert out.prompt_token_ids == ref_prompt, text
        assert list(out.outputs[0].token_ids) == ref_tokens, text
    stats = llm.engine.scheduler.stats()
    assert stats.encoder_cache.num_encoder_runs >= 4  # each of the 4 images at least once
    if "kv_cache" in setup:
        assert stats.num_preemptions_total > 0, "the KV pool was meant to force preemption"


def test_image_tokens_are_prompt_tokens(llava_dir):
    llm = LLM(str(llava_dir), dtype="float32")
    text, images = PROMPTS[2]
    out = llm.generate(_prompt(text, images), SamplingParams(max_tokens=2), use_tqdm=False)[0]
    plain = len(llm.tokenizer.encode(text))
    assert len(out.prompt_token_ids) == plain + 2 * (NUM_IMAGE_TOKENS - 1)


def test_repeated_image_is_encoded_once_and_shares_blocks(llava_dir):
    llm = LLM(str(llava_dir), dtype="float32", kv_cache={"block_size": 4})
    text = f"Look at {IMAGE_TOKEN} and say what you see in it please."
    image, other = make_image(7), make_image(8)
    first = llm.generate(_prompt(text, [image]), _greedy(), use_tqdm=False)[0]
    # The same pixels in a new PIL object: the content hash, not the object, is the key.
    again = llm.generate(_prompt(text, [image.copy()]), _greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Another text before the same image: no block is shared, the image's KV is computed
    # again, from the encoder cache.
    other_text = llm.generate(_prompt("Now " + text, [image]), _greedy(), use_tqdm=False)[0]
    assert other_text.num_cached_tokens == 0
    stats = llm.engine.scheduler.stats().encoder_cache
    runner = llm.engine.executor.runner
    assert stats.num_encoder_runs == 1 and runner.mm.num_encoder_runs == 1
    assert stats.hits == 1 and stats.num_cached_tokens == NUM_IMAGE_TOKENS
    # Same text, same image: the whole prompt's full blocks are shared.
    n_prompt = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n_prompt - 1) // 4 * 4
    # Same text, another image: only the blocks before the image's first placeholder.
    image_id = llm.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    image_start = first.prompt_token_ids.index(image_id)
    diff = llm.generate(_prompt(text, [other]), _greedy(), use_tqdm=False)[0]
    assert diff.num_cached_tokens == image_start // 4 * 4
    assert llm.engine.scheduler.stats().encoder_cache.num_encoder_runs == 2
    assert diff.outputs[0].token_ids != first.outputs[0].token_ids


def test_encoder_cache_evicts_within_its_size(llava_dir):
    # Room for one image's outputs: a second image evicts the first (unreferenced) one.
    llm = LLM(str(llava_dir), dtype="float32",
              scheduler={"encoder_cache_size": NUM_IMAGE_TOKENS})
    text = f"Look at {IMAGE_TOKEN} now."
    a, b = make_image(11), make_image(12)
    for im in (a, b, a):
        llm.generate(_prompt(text, [im]), SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.engine.scheduler.stats().encoder_cache
    assert stats.num_encoder_runs == 3 and stats.num_cached_tokens == NUM_IMAGE_TOKENS
    assert len(llm.engine.executor.runner.mm.encoder_cache) == 1


def test_bad_multimodal_inputs_fail_before_the_engine(llava_dir, tiny_model_dir):
    llm = LLM(str(llava_dir), dtype="float32", overrides=["multimodal.limit_mm_per_prompt.image=1"])
    image = make_image(5)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": image}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(f"an {IMAGE_TOKEN} without its image", use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(_prompt(f"{IMAGE_TOKEN}{IMAGE_TOKEN}", [image, image]), use_tqdm=False)
    with pytest.raises(ValueError, match="PIL"):
        llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": "a.png"}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="modalities"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": [image]}}, use_tqdm=False)
    # The engine still serves.
    assert llm.generate(_prompt(f"ok {IMAGE_TOKEN}", [image]), SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].outputs[0].token_ids
    text_llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    with pytest.raises(ValueError, match="takes no images"):
        text_llm.generate(_prompt("hi", [image]), use_tqdm=False)


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_llm_chat_with_image_parts_matches_generate(llava_dir):
    llm = LLM(str(llava_dir), dtype="float32")
    image = make_image(21)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                         {"type": "image_url",
                                          "image_url": {"url": _data_url(image)}},
                                         {"type": "text", "text": "?"}]}]
    chat = llm.chat(msgs, _greedy(), use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is in {IMAGE_TOKEN}?"}], tokenize=False,
        add_generation_prompt=True)
    ref = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
                        "multi_modal_data": {"image": image}}, _greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids == ref.prompt_token_ids
    assert chat.outputs[0].token_ids == ref.outputs[0].token_ids
    pil = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                                 {"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "?"}]}],
                   _greedy(), use_tqdm=False)[0]
    assert pil.outputs[0].token_ids == ref.outputs[0].token_ids


def test_encoder_budget_below_one_image_fails_at_start_up(llava_dir):
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError, match="scheduler.encoder_cache_size"):
        LLM(str(llava_dir), dtype="float32", scheduler={"encoder_cache_size": 8})
    with pytest.raises(ConfigError, match="scheduler.max_num_encoder_input_tokens"):
        LLM(str(llava_dir), dtype="float32", scheduler={"max_num_encoder_input_tokens": 8})


def test_scheduler_defers_an_image_past_the_step_encoder_budget():
    """Two images of 16 tokens, an encoder budget of 16 per step: the first step computes up
    to the second image's first placeholder; the second encodes it; nothing is encoded
    twice."""
    from llmkit.config.schema import SchedulerConfig
    from llmkit.kv_cache.manager import KVCacheManager
    from llmkit.multimodal.base import MultiModalFeatureSpec
    from llmkit.outputs import ModelRunnerOutput
    from llmkit.request import Request
    from llmkit.scheduler.token_budget import TokenBudgetScheduler

    cfg = SchedulerConfig(max_num_encoder_input_tokens=16, encoder_cache_size=32)
    sched = TokenBudgetScheduler(cfg, KVCacheManager(num_blocks=64, block_size=4),
                                 max_model_len=256)
    feats = [MultiModalFeatureSpec("a", 2, 16), MultiModalFeatureSpec("b", 20, 16)]
    sched.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=1),
                              mm_features=feats))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 20} and so.scheduled_encoder_inputs == {"r": [0]}
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 20} and so.scheduled_encoder_inputs == {"r": [1]}
    stats = sched.stats().encoder_cache
    assert stats.num_encoder_runs == 2 and stats.num_cached_tokens == 32
    # Both images are computed: unreferenced, still cached, evictable.
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]]))
    assert sched.encoder_cache.num_freeable_slots == 32
    # A new request with image "a" finds it cached; one with "c" evicts the oldest entry.
    sched.add_request(Request("s", list(range(100, 120)), SamplingParams(max_tokens=1),
                              mm_features=[MultiModalFeatureSpec("a", 0, 16)]))
    sched.add_request(Request("t", list(range(200, 220)), SamplingParams(max_tokens=1),
                              mm_features=[MultiModalFeatureSpec("c", 0, 16)]))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"t": [0]}
    assert so.free_encoder_mm_hashes == ["b"]
    assert sched.stats().encoder_cache.hits == 1


def test_image_urls_only_from_allowed_hosts_and_redirects():
    """``load_image_url``: data URLs decode; an http URL is fetched only from an allowed host,
    and a redirect from an allowed host to another one is refused."""
    import http.server
    import io
    import threading

    from llmkit.multimodal.image import ImageError, load_image_url

    buf = io.BytesIO()
    make_image(31).save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/a.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        image = load_image_url(f"{base}/a.png", max_bytes=10**6, allowed_domains=["127.0.0.1"])
        assert image.tobytes() == make_image(31).tobytes()
        with pytest.raises(ImageError, match="allowed_media_domains"):
            load_image_url(f"{base}/a.png", max_bytes=10**6, allowed_domains=[])
        with pytest.raises(ImageError, match="'localhost'"):
            load_image_url(f"{base}/redirect", max_bytes=10**6, allowed_domains=["127.0.0.1"])
        with pytest.raises(ImageError, match="max_image_bytes"):
            load_image_url(f"{base}/a.png", max_bytes=100, allowed_domains=["127.0.0.1"])
    finally:
        server.shutdown()


def test_cli_generate_with_image_files(llava_dir, tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "a.png"
    make_image(41).save(path)
    prompt = f"Describe {IMAGE_TOKEN} briefly."
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llmkit.entrypoints.cli", "generate", str(llava_dir),
           "--prompt", prompt, "--image", str(path), "model.dtype=float32",
           "sampling.max_tokens=6", "sampling.temperature=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    llm = LLM(str(llava_dir), dtype="float32")
    ref = llm.generate(_prompt(prompt, [Image.open(path)]),
                       SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    assert out.stdout.rstrip("\n") == ref.outputs[0].text
    bad = subprocess.run(cmd[:-3] + ["--image", str(tmp_path / "missing.png")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "missing.png" in bad.stderr


def test_async_llm_chat_with_an_image_matches_llm(llava_dir):
    """The engine in its own process: features cross as plain data (msgpack)."""
    import asyncio

    from llmkit.config.compose import build_config
    from llmkit.engine.async_llm import AsyncLLM

    image = make_image(51)
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is it?"}]}]
    ref = LLM(str(llava_dir), dtype="float32").chat(msgs, _greedy(), use_tqdm=False)[0]
    config = build_config(str(llava_dir), dtype="float32",
                          groups={"platform": {"num_threads": 1}})
    threads = torch.get_num_threads()
    engine = AsyncLLM.from_config(config)
    try:
        async def run():
            return [o async for o in engine.chat(msgs, _greedy())][-1]

        out = asyncio.run(run())
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_prefix_hit_ending_inside_an_image(llava_dir, hf_reference):
    """A cached prefix that ends inside an image: the rest of the image's tokens take their
    slice of the cached encoder output, and the result is HF's."""
    llm = LLM(str(llava_dir), dtype="float32", kv_cache={"block_size": 4})
    image = make_image(61)
    # "Hi" + image: the image's last placeholders share a block with the differing suffix.
    first_text, second_text = f"Hi {IMAGE_TOKEN} a cat", f"Hi {IMAGE_TOKEN} the sea"
    llm.generate(_prompt(first_text, [image]), _greedy(), use_tqdm=False)
    out = llm.generate(_prompt(second_text, [image]), _greedy(), use_tqdm=False)[0]
    image_id = llm.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = out.prompt_token_ids
    start = ids.index(image_id)
    end = start + NUM_IMAGE_TOKENS
    assert start < out.num_cached_tokens < end, (start, out.num_cached_tokens, end)
    stats = llm.engine.scheduler.stats().encoder_cache
    assert stats.num_encoder_runs == 1 and stats.hits == 1
    ref_prompt, ref_tokens = hf_reference(second_text, [image])
    assert ids == ref_prompt and list(out.outputs[0].token_ids) == ref_tokens


def test_llava_with_a_siglip_tower_matches_hf(tmp_path):
    """A SigLIP vision tower (patch bias, no CLS, no pre-norm; the ``full`` strategy keeps
    every patch), one and two images per prompt, batched with text: HF's greedy tokens."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = build_llava_dir(tmp_path / "tiny-llava-siglip", tower="siglip")
    processor = AutoProcessor.from_pretrained(str(path))
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    llm = LLM(str(path), dtype="float32", scheduler={"max_num_batched_tokens": 7})
    outs = llm.generate([_prompt(t, ims) for t, ims in prompts], _greedy(), use_tqdm=False)
    for (text, images), out in zip(prompts, outs):
        inputs = processor(text=[text], images=images, return_tensors="pt") if images else \
            processor.tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS)
        n = inputs["input_ids"].shape[1]
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist(), text
        assert list(out.outputs[0].token_ids) == ref[0, n:].tolist(), text
    assert out.prompt_token_ids.count(model.config.image_token_id) == 2 * NUM_IMAGE_TOKENS
