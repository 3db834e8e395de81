"""A tiny Llama that writes a script: its greedy next token depends on the current token alone
(layers scaled down to a whisper, the LM head scoring token b after token a where the script
says so), so a test can make it write markers a random model never would, e.g. a reasoning
model's ``<think>…</think>``. Used by the reasoning and Responses API server tests."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.tiny_models import CHAT_TEMPLATE, build_tokenizer, make_config

# Qwen3's switch: enable_thinking=false closes an empty thinking block in the prompt.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{ '<think></think>' }}{% endif %}")


def thinking_tokenizer():
    """The tiny tokenizer with ``<think>`` and ``</think>`` as single tokens (as Qwen3 has)
    and a template that knows ``enable_thinking``."""
    tok = build_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    return tok


def single_tokens(tokenizer, words: list[str]) -> list[int]:
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids), dict(zip(words, ids))
    return [i[0] for i in ids]


def build_scripted_model_dir(out: Path, tokenizer, script: dict[int, int], *, seed: int = 0,
                             layer_scale: float = 0.05, **overrides) -> Path:
    """Save the model: after token a, greedy decoding writes ``script[a]`` (other tokens'
    successors are arbitrary but never outscore a scripted one)."""
    from transformers import AutoModelForCausalLM

    config = make_config("llama", tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        dim = emb.shape[1]
        # rms 1: the final norm leaves them as they are; a scripted logit is |e|^2 = dim,
        # any other ~N(0, dim ** 0.5 ... ) well below it
        emb.copy_(torch.nn.functional.normalize(torch.randn_like(emb), dim=1) * dim ** 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for a, b in script.items():
            head[b] += emb[a]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
