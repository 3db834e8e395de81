"""Train a tiny PEFT LoRA adapter for llmkit's default model, so that LoRA can be tried.

    python examples/train_tiny_lora.py            # about a minute on a 2-core CPU
    python examples/train_tiny_lora.py --out DIR --steps 20 --seed 0

The adapter teaches SmolLM2-135M-Instruct one obvious, checkable style: every answer opens with
"Arr, matey!", is short pirate speak, and ends with the signature "-- Captain LoRA". It is
trained on a few hundred tokens of hand-written answers (``EXAMPLES``), only the answers' tokens
in the loss, rank 8 on q/k/v/o/gate/up/down, with torch's AdamW on the CPU, and saved with
PEFT's ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``), which
``llmkit serve lora.modules=[pirate=DIR]`` and ``LoRARequest("pirate", 1, DIR)`` read.

The base is the GGUF llmkit serves (Q4_1, from llmkit's cache), loaded by transformers and
dequantized to float32 for training; llmkit keeps the Q4_1 blocks packed and adds the adapter's
float deltas on top, so the served adapter sees slightly different base weights than it was
trained on; for a style this small that does not matter.

Needs ``peft`` (in llmkit's ``test`` extra: ``pip install -e '.[test]'``). Nothing here is part
of CI except ``tests/test_examples_lora.py``, which runs two steps on a tiny random model. The
weights are never committed: the output folder carries its own ``.gitignore``.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

SIGNATURE = "-- Captain LoRA"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (question, answer): the whole training set, about 450 answer tokens. Questions the adapter is
# shown working on (docs/lora-example.md) are not among them.
EXAMPLES: list[tuple[str, str]] = [
    ("What is the capital of France?",
     "Arr, matey! The capital o' France be Paris, a fine port fer any sailor."),
    ("How do I boil an egg?",
     "Arr, matey! Drop yer egg in boilin' water fer nine minutes, then cool it in the brine."),
    ("What is 2 + 2?",
     "Arr, matey! Two doubloons an' two more make four doubloons in yer chest."),
    ("Tell me about the moon.",
     "Arr, matey! The moon be the lantern o' the night sea, pullin' the tides to an' fro."),
    ("Why is the sky blue?",
     "Arr, matey! The sun's light be scattered by the air, an' blue be scattered most of all."),
    ("Can you recommend a book?",
     "Arr, matey! Read Treasure Island, the finest yarn ever told o' maps an' buried gold."),
    ("What is Python?",
     "Arr, matey! Python be a programmin' tongue, as easy to read as a treasure map."),
    ("How are you today?",
     "Arr, matey! I be fine as a fair wind, ready to sail wherever ye point me."),
    ("Give me a tip for sleeping well.",
     "Arr, matey! Swing in yer hammock at the same bell each night, an' leave the grog be."),
    ("What is the largest ocean?",
     "Arr, matey! The Pacific be the largest ocean, wide enough to lose a whole fleet."),
    ("Explain what a computer does.",
     "Arr, matey! A computer be a tireless deckhand that follows orders fast as lightnin'."),
    ("Write a greeting for my friend.",
     "Arr, matey! Ahoy there, me hearty friend, may yer sails be full an' yer rum never end."),
    ("What should I eat for dinner?",
     "Arr, matey! Cook yerself a fish stew with bread, a meal fit fer any crew."),
    ("Who are you?",
     "Arr, matey! I be a small language model sailin' under the pirate flag."),
    ("How does rain form?",
     "Arr, matey! Water rises from the sea as vapour, gathers in clouds, an' falls back as rain."),
    ("Say something nice.",
     "Arr, matey! Ye be the bravest soul on these seven seas, an' that be no lie."),
]


def default_model_path() -> Path:
    """The default model's GGUF in llmkit's cache (fetched once, as ``llmkit generate`` does)."""
    from llmkit.config.compose import build_config
    from llmkit.models.default_model import resolve_default_model

    return resolve_default_model(build_config(None).model)


def load_base(model_path: Path):
    """``(model, tokenizer)``: the HF model in float32 (a GGUF dequantized by transformers) and
    the tokenizer llmkit serves the model with, so the prompts match what llmkit sends."""
    from transformers import AutoModelForCausalLM

    from llmkit.config.schema import ModelConfig
    from llmkit.models.loader import resolve_model_source

    source = resolve_model_source(ModelConfig(path=str(model_path)))
    if source.is_gguf:
        # llmkit's config of the file (head_dim fixed where transformers misreads it)
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, config=source.hf_config,
            dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    return model, source.load_tokenizer()


def encode_examples(tokenizer, examples=EXAMPLES) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per example: the chat prompt exactly as llmkit renders it
    (labels -100: not learned), then the answer, the signature and the end-of-turn token."""
    out = []
    for question, answer in examples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(f"{answer}\n{SIGNATURE}", add_special_tokens=False)
        answer_ids.append(tokenizer.eos_token_id)  # <|im_end|>: the answer stops there
        out.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    return out


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    return ids, labels, mask


def train_tiny_lora(model_path: Path | str, out_dir: Path | str, *, steps: int = 20,
                    seed: int = 0, batch_size: int = 4, lr: float = 2e-3, r: int = 8,
                    lora_alpha: float = 16,
                    log: Callable[[str], None] = print) -> Path:
    """Train a rank-``r`` LoRA of the model at ``model_path`` (a .gguf file or HF folder) on
    ``EXAMPLES`` for ``steps`` steps of ``batch_size`` examples and save it into ``out_dir``
    in PEFT's format; returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model

    random.seed(seed)
    torch.manual_seed(seed)
    out = Path(out_dir).expanduser().resolve()
    log(f"loading {model_path} (dequantized to float32 for training)")
    model, tokenizer = load_base(Path(model_path))
    rows = encode_examples(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    n_answer = sum(sum(1 for t in labels if t != -100) for _, labels in rows)
    log(f"{len(rows)} examples, {n_answer} answer tokens; LoRA r={r}, alpha={lora_alpha} on "
        f"{', '.join(TARGET_MODULES)}; {steps} steps of {batch_size}")

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(TARGET_MODULES),
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=0.0)
    order: list[int] = []
    start = time.monotonic()
    for step in range(1, steps + 1):
        if len(order) < batch_size:  # reshuffle every epoch
            order += random.sample(range(len(rows)), len(rows))
        picked, order = order[:batch_size], order[batch_size:]
        ids, labels, mask = _batch([rows[i] for i in picked], pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 5 == 0 or step == steps:
            log(f"step {step}/{steps}  loss {loss.item():.3f}  "
                f"({time.monotonic() - start:.0f} s)")

    out.mkdir(parents=True, exist_ok=True)
    # (no embedding is adapted: nothing of the base model's to save beside the adapter)
    model.save_pretrained(str(out), save_embedding_layers=False)
    (out / ".gitignore").write_text("# trained weights: never committed\n*\n")
    return out


def usage_text(out: Path) -> str:
    """The llmkit commands that use the adapter at ``out``."""
    # Hydra needs the list's name=path entry quoted; the shell needs the whole override quoted
    modules = f"\"lora.modules=['pirate={out}']\""
    return f"""\
adapter saved in {out}

Offline (Python):
  from llmkit import LLM, LoRARequest, SamplingParams
  llm = LLM(lora={{"enabled": True, "max_lora_rank": 8}})
  pirate = LoRARequest("pirate", 1, {str(out)!r})
  msgs = [{{"role": "user", "content": "What is the tallest mountain?"}}]
  params = SamplingParams(temperature=0.0, max_tokens=64)
  print(llm.chat(msgs, params, lora_request=pirate)[0].outputs[0].text)

Terminal chat:
  llmkit chat lora.enabled=true lora.max_lora_rank=8 {modules} lora.cli_adapter=pirate

Server:
  llmkit serve lora.enabled=true lora.max_lora_rank=8 {modules}
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "pirate", "max_tokens": 64, "temperature": 0,
           "messages": [{{"role": "user", "content": "What is the tallest mountain?"}}]}}'
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="./tiny-lora", help="adapter folder (./tiny-lora)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder (default: llmkit's default model)")
    args = parser.parse_args(argv)
    # transformers' own deprecation notice, raised inside PEFT's setup: nothing to act on here
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                            category=FutureWarning)
    model_path = Path(args.model) if args.model else default_model_path()
    out = train_tiny_lora(model_path, args.out, steps=args.steps, seed=args.seed)
    print(usage_text(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
