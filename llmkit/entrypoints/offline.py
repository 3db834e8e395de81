"""`llmkit generate` and `llmkit chat`: the offline engine behind a terminal."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

from llmkit.config.schema import EngineConfig
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
    start = time.perf_counter()
    n = 0
    for out in llm.stream(request, params, lora_request=lora):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
        n += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def run_chat(config: EngineConfig) -> int:
    import dataclasses

    from llmkit.entrypoints.chat_history import ChatHistory

    llm = _start_llm(config)
    params = sampling_params_from(config)
    lora = cli_lora_request(llm, config)
    limit, max_reply = llm.max_model_len, config.chat.max_tokens
    # A reply always has room for min(chat.max_tokens, half the context).
    history = ChatHistory(llm.apply_chat_template, limit - min(max_reply, limit // 2))
    name = config.model.served_name or config.model.name or "model"
    if lora is not None:
        name = f"{name} + LoRA adapter {lora.lora_name}"
    print(f"llmkit chat with {name} — empty line or Ctrl-D to quit, /reset to forget "
          f"(replies up to chat.max_tokens={max_reply} tokens).", file=sys.stderr)
    while True:
        try:
            user = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not user.strip():
            return 0
        if user.strip() == "/reset":
            history.clear()
            print("[conversation forgotten: the next message starts a new one]",
                  file=sys.stderr)
            continue
        history.add("user", user)
        prompt = history.fit()
        if prompt.dropped_turns:
            print(f"[the conversation outgrew model.max_model_len={limit}: dropped the "
                  f"oldest {prompt.dropped_turns} turn(s)]", file=sys.stderr)
        if prompt.token_ids is None:
            history.pop()
            print(f"[this message alone is too long for model.max_model_len={limit}; "
                  "shorten it]", file=sys.stderr)
            continue
        max_tokens = min(max_reply, limit - len(prompt.token_ids))
        reply, finish = [], None
        try:
            for out in llm.stream(prompt.token_ids,
                                  dataclasses.replace(params, max_tokens=max_tokens),
                                  lora_request=lora):
                piece = out.outputs[0].text
                reply.append(piece)
                finish = out.outputs[0].finish_reason or finish
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            finish = "interrupted"  # stop this answer, keep the conversation
        sys.stdout.write("\n")
        if finish == "length":
            if max_tokens < max_reply:
                print(f"[reply cut: the context is full (model.max_model_len={limit}); the "
                      "oldest turns go next]", file=sys.stderr)
            else:
                print(f"[reply cut at chat.max_tokens={max_reply} tokens; raise "
                      "chat.max_tokens for longer replies]", file=sys.stderr)
        history.add("assistant", "".join(reply))
