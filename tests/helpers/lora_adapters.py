"""PEFT LoRA adapters for the tiny test models, built with peft itself (``LoraConfig`` +
``get_peft_model`` on the tiny HF model, A and B randomised, ``save_pretrained``), and the
Hugging Face reference: the adapter merged into the base (``merge_and_unload``)."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(model_dir: Path, out: Path, *, r: int, lora_alpha: float,
                  target_modules=ALL_LINEAR, seed: int = 0, std: float = 0.15,
                  **lora_kwargs) -> Path:
    """A random, non-zero adapter of ``model_dir`` saved in PEFT's format into ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                        lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    peft_model.save_pretrained(str(out))
    return out


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """The HF reference: the base model, with the adapter merged in when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` (token ids), no EOS stop."""
    ids = torch.tensor([prompt])
    out = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


from llmkit.linear.torch_linear import TorchLinearMethod  # noqa: E402


class NoLoRALinearMethod(TorchLinearMethod):
    """A linear method that says it cannot be wrapped by LoRA (``supports_lora = False``)."""

    supports_lora = False
