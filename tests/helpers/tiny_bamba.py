"""A tiny random Bamba (Mamba-2 mixers + attention layers) saved as a Hugging Face folder with
the tiny tokenizer, built with transformers so that llmkit loads it like a real checkpoint and
HF serves as the reference."""
from __future__ import annotations

from pathlib import Path

import torch

ATTN_LAYERS = [1, 4]
# Non-default values the tests must exercise: two B/C groups, an SSD chunk shorter than the
# prompts (the scan crosses chunk boundaries inside a prompt), a bias on the conv. A state
# small beside a token's K/V (d_state 8, 4 KV heads) keeps the pool's blocks at 16 tokens
# (the runner raises the block size until an attention page holds a state).
BAMBA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5,
             attn_layer_indices=ATTN_LAYERS, num_attention_heads=4, num_key_value_heads=4,
             mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=8,
             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_conv_bias=True,
             max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
# The SSM's own parameters keep transformers' init (A = -1..-n_heads, dt_bias 1, D 1): scaled
# by 3 they would make A = -n^3 and every head forget within a token.
KEEP_INIT = ("A_log", "dt_bias", ".D")


def build_bamba_dir(out: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A tiny random Bamba saved with safetensors and ``tokenizer`` (weights x3 as in
    ``helpers.tiny_models``, except the SSM's decay parameters)."""
    from transformers import AutoModelForCausalLM, BambaConfig

    config = BambaConfig(**{**BAMBA, "vocab_size": len(tokenizer),
                            "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id,
                            "pad_token_id": tokenizer.pad_token_id, **overrides})
    config.architectures = ["BambaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(KEEP_INIT):
                continue
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            param.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
