"""`llmkit generate` and `llmkit chat`: the offline engine behind a terminal."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

from llmkit.config.schema import EngineConfig
from llmkit.entrypoints.reply_stats import spec_decode_line, spec_decode_reading
from llmkit.sampling.params import SamplingParams


def sampling_params_from(config: EngineConfig) -> SamplingParams:
    d = config.sampling
    return SamplingParams(max_tokens=d.max_tokens, temperature=d.temperature, top_p=d.top_p,
                          top_k=d.top_k, min_p=d.min_p, seed=d.seed)


def _start_llm(config: EngineConfig):
    """The engine (the CLI shows its slow start-up steps on stderr)."""
    from llmkit.startup import startup_step

    with startup_step("loading torch and transformers"):
        from llmkit.engine.llm import LLM
    return LLM.from_config(config)


def cli_lora_request(llm, config: EngineConfig):
    """The ``LoRARequest`` of ``lora.cli_adapter`` (loaded at start from ``lora.modules``), or
    None for the base model."""
    name = config.lora.cli_adapter
    if name is None:
        return None
    return next(lr for lr in llm.list_loras() if lr.lora_name == name)


def run_generate(config: EngineConfig, prompt: str, images: Sequence[str] = ()) -> int:
    request: str | dict = prompt
    if images:
        from llmkit.multimodal.image import decode_image

        # Files the user names on the command line (a server request never reads files).
        loaded = [decode_image(Path(p).read_bytes(),
                               max_bytes=config.multimodal.max_image_bytes) for p in images]
        request = {"prompt": prompt, "multi_modal_data": {"image": loaded}}
    llm = _start_llm(config)
    params = sampling_params_from(config)
    lora = cli_lora_request(llm, config)
    spec_start = spec_decode_reading(llm)
    start = time.perf_counter()
    n = 0
    for out in llm.stream(request, params, lora_request=lora):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
        n += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s]", file=sys.stderr)
    if spec_start is not None:
        # Speculation keeps the outputs' distribution and changes only the speed: without
        # this line a user cannot tell that it runs at all.
        spec = spec_decode_reading(llm).since(spec_start)
        print(f"[{spec_decode_line(spec, config.speculative)}]", file=sys.stderr)
    return 0


def run_chat(config: EngineConfig) -> int:
    from llmkit.entrypoints.terminal_chat import run_chat_loop

    llm = _start_llm(config)
    return run_chat_loop(llm, config, sampling_params_from(config),
                         lora=cli_lora_request(llm, config))
