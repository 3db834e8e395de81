"""Images through the OpenAI server (issue 23): chat content parts with data URLs via the
official ``openai`` client, compared with the offline ``LLM.chat``; remote URLs refused by
default; oversized, too many and corrupt images answer 400 without touching other requests."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from helpers.server_process import SERVER_THREADS, ServerProcess
from helpers.tiny_llava import build_llava_dir

from llmkit import LLM, SamplingParams

MAX_IMAGE_BYTES = 8000


def make_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import torch

    model_dir = build_llava_dir(tmp_path_factory.mktemp("tiny-llava-server"))
    server = ServerProcess(model_dir, SERVER_THREADS,
                           f"multimodal.max_image_bytes={MAX_IMAGE_BYTES}",
                           "multimodal.limit_mm_per_prompt.image=2",
                           log_path=tmp_path_factory.mktemp("server") / "server.log")
    threads = torch.get_num_threads()
    try:
        offline = LLM(str(model_dir), dtype="float32", platform={"num_threads": 1},
                      overrides=[f"multimodal.max_image_bytes={MAX_IMAGE_BYTES}"])
        server.wait_ready()
        yield server, offline
    finally:
        server.stop()
        torch.set_num_threads(threads)


def test_chat_with_data_url_images_matches_offline(env):
    server, offline = env
    client = server.client()
    model = client.models.list().data[0].id
    for urls in ([data_url(make_image(1))], [data_url(make_image(2)), data_url(make_image(3))]):
        messages = image_message(*urls)
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                              temperature=0.0)
        ref = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0.0),
                           use_tqdm=False)[0]
        assert resp.choices[0].message.content == ref.outputs[0].text
        # Image tokens are prompt tokens.
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                temperature=0.0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    metrics = server.metrics()
    # The streamed repeats found their images in the encoder cache or the prefix cache.
    assert metrics["llmkit:encoder_runs_total"] == 3


@pytest.mark.parametrize("urls, match", [
    (["https://example.com/cat.png"], "allowed_media_domains"),
    (["file:///etc/passwd"], "not allowed"),
    (["data:image/png;base64," + base64.b64encode(b"not a png at all").decode()],
     "cannot be decoded"),
    (["data:image/png;base64,@@@"], "base64"),
    (["data:text/plain;base64,aGk="], "not an image"),
    ([data_url(make_image(5, (160, 160)))], "max_image_bytes"),
    ([data_url(make_image(6))] * 3, "limit_mm_per_prompt"),
], ids=["remote", "file", "corrupt", "bad-base64", "not-image", "oversized", "too-many"])
def test_bad_images_answer_400_and_others_are_served(env, urls, match):
    server, offline = env
    good = image_message(data_url(make_image(7)))
    ref = offline.chat(good, SamplingParams(max_tokens=6, temperature=0.0),
                       use_tqdm=False)[0].outputs[0].text

    async def run():
        client = server.async_client()
        model = (await client.models.list()).data[0].id
        ok = asyncio.create_task(client.chat.completions.create(
            model=model, messages=good, max_tokens=6, temperature=0.0))
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=model, messages=image_message(*urls),
                                                 max_tokens=6)
        return (await ok).choices[0].message.content, err.value

    text, err = asyncio.run(run())
    assert text == ref
    assert err.status_code == 400 and match in err.body["message"], err.body
    assert set(err.body) == {"message", "type", "param", "code"}
