"""`llmkit generate` and `llmkit chat`: the offline engine behind a terminal."""
from __future__ import annotations

import sys
import time

from llmkit.config.schema import EngineConfig
from llmkit.sampling.params import SamplingParams


def sampling_params_from(config: EngineConfig) -> SamplingParams:
    d = config.sampling
    return SamplingParams(max_tokens=d.max_tokens, temperature=d.temperature, top_p=d.top_p,
                          top_k=d.top_k, min_p=d.min_p, seed=d.seed)


def run_generate(config: EngineConfig, prompt: str) -> int:
    from llmkit.engine.llm import LLM

    llm = LLM.from_config(config)
    params = sampling_params_from(config)
    start = time.perf_counter()
    n = 0
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
        n += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def run_chat(config: EngineConfig) -> int:
    from llmkit.engine.llm import LLM

    llm = LLM.from_config(config)
    params = sampling_params_from(config)
    history: list[dict[str, str]] = []
    name = config.model.served_name or config.model.name or "model"
    print(f"llmkit chat with {name} — empty line or Ctrl-D to quit, /reset to forget.",
          file=sys.stderr)
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
            continue
        history.append({"role": "user", "content": user})
        reply = []
        try:
            for out in llm.stream(llm.apply_chat_template(history), params):
                piece = out.outputs[0].text
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
