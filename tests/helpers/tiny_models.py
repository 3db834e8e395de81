"""Tiny random models and a tiny tokenizer for tests: built with transformers, saved as a
Hugging Face folder (safetensors + tokenizer), so llmkit loads them like any real model."""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few KB of plain English to train the byte-level BPE on.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system keeps many requests in flight at
once, and every request needs memory for the keys and values of the tokens it has seen. The
scheduler decides, at every step, which requests run and how many of their tokens are computed.
When the cache is full, a request may be paused and its blocks given back, then computed again
later. Short prompts finish quickly; long prompts are cut into chunks so that other requests can
still make progress. The model reads the tokens, looks at what came before, and writes the next
one. People ask questions about the weather, about history, about cooking and about travel.
What is the capital of France? Paris is the capital of France, and Berlin is the capital of
Germany. The river flows through the city and the bridges are old and beautiful. In the morning
the market opens early and the bakers sell fresh bread to the people who walk past. Children go
to school, workers go to the office, and the trains are full of people reading and talking.
Hello, how are you today? I am fine, thank you. Could you tell me a story about a small robot
that wanted to learn how to paint? Once upon a time there was a little robot who lived in a
quiet town near the sea. Every day it watched the painters on the beach and wondered how they
chose their colours. One day it found a brush in the sand and began to paint the sky, the waves
and the boats. The painters laughed at first, but then they saw that the robot had painted the
light of the evening better than any of them. From that day on the robot painted every evening,
and the people of the town came to watch. Numbers matter too: one, two, three, four, five, six,
seven, eight, nine, ten, eleven, twelve, twenty, thirty, a hundred, a thousand. The answer is
forty two. Please write a short poem about the moon. The moon is bright, the night is long, the
stars are singing their quiet song. Thank you for your help! You are welcome. Goodbye and see
you soon. Water boils at one hundred degrees and freezes at zero. The sun rises in the east and
sets in the west. Computers store numbers as bits, and a byte holds eight of them. A token is a
piece of a word; a sentence becomes a list of tokens, and the model predicts them one by one.
"""

TOKENIZER_VOCAB_SIZE = 640

# Hugging Face config class per short architecture name, and what varies between them.
ARCHS = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False, "num_hidden_layers": 2}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": True, "num_hidden_layers": 2,
                                  "sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "num_hidden_layers": 3}),
    # MoE (issue 22): 4-8 small experts, top-2
    "mixtral": ("MixtralConfig", {"tie_word_embeddings": False, "num_hidden_layers": 2,
                                  "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 64, "sliding_window": None}),
    # a shared expert; layer 1 dense (mlp_only_layers); top-k not renormalised; qkv bias
    "qwen2_moe": ("Qwen2MoeConfig", {"tie_word_embeddings": True, "num_hidden_layers": 3,
                                     "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64,
                                     "mlp_only_layers": [1], "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", {"tie_word_embeddings": False, "num_hidden_layers": 2,
                                     "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
}
BASE_CONFIG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
                   rope_theta=10000.0)


def build_tokenizer():
    """A byte-level BPE tokenizer trained on ``CORPUS`` (eos ``<|im_end|>``, a ChatML
    template), as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, chat_template=CHAT_TEMPLATE)


def make_config(arch: str, tokenizer, **overrides):
    """A tiny config of ``arch`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``mixtral``,
    ``qwen2_moe``, ``qwen3_moe``): hidden 64,
    4 heads, 2 KV heads, head_dim 16, vocab = the tokenizer's."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCHS)}")
    class_name, arch_defaults = ARCHS[arch]
    kwargs = {**BASE_CONFIG, **arch_defaults,
              "vocab_size": len(tokenizer),
              "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id,
              **overrides}
    return getattr(transformers, class_name)(**kwargs)


def build_model_dir(arch: str, out: Path, tokenizer, *, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random ``arch`` model (every weight scaled by 3, so that logits are peaked
    and greedy choices do not flip on rounding) and ``tokenizer`` into ``out``."""
    from transformers import AutoModelForCausalLM

    config = make_config(arch, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms start at ones: make them random too
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            param.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    tokenizer.save_pretrained(str(out))
    return out


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's reordering of q/k rows for its rope layout (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny_gguf(model_dir: Path, out: Path, weight_type: str | None = None,
                    type_of: dict[str, str] | None = None) -> Path:
    """Convert a tiny model folder to a GGUF file the way llama.cpp would (llama/mistral q/k
    rows permuted; weights Q8_0, the output matrix Q4_0, the embedding F16, norms F32; the
    tokenizer and chat template in the metadata).

    ``weight_type`` (a GGUF type name: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) puts every matrix, the
    embedding and output included, in that type, or in ``type_of[gguf short name]`` (e.g.
    ``{"attn_v": "Q6_K"}``). gguf-py cannot quantize Q4_K / Q6_K: their matrices are random
    valid blocks (``helpers.gguf_rows``) in place of the model's values."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[
        config.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny {config.model_type}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    w.add_token_list(vocab)
    special = set(tokenizer.all_special_tokens) | set(SPECIAL_TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    Q = gguf.GGMLQuantizationType
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        module, _, kind = name.rpartition(".")
        if module.startswith("model.layers."):
            layer, _, rest = module[len("model.layers."):].partition(".")
            gguf_name = f"blk.{layer}.{names[rest]}.{kind}"
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if rest.endswith("q_proj") \
                    else config.num_key_value_heads
                array = _llama_cpp_permute(array, heads)
        else:
            gguf_name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                         "lm_head": "output"}[module] + f".{kind}"
        if array.ndim == 1:
            w.add_tensor(gguf_name, array)
        elif weight_type is not None:
            short = gguf_name.split(".")[-2]
            qtype = getattr(Q, (type_of or {}).get(short, weight_type))
            if qtype in (Q.Q4_K, Q.Q6_K):
                from helpers.gguf_rows import random_gguf_rows
                import zlib
                raw = random_gguf_rows(qtype.name.lower(), *array.shape,
                                       seed=zlib.crc32(gguf_name.encode()), scale=0.004).numpy()
            else:
                raw = gguf.quants.quantize(array, qtype)
            w.add_tensor(gguf_name, raw, raw_dtype=qtype)
        elif gguf_name == "token_embd.weight":
            w.add_tensor(gguf_name, array.astype(np.float16))
        else:
            qtype = Q.Q4_0 if gguf_name == "output.weight" else Q.Q8_0
            w.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build_eagle_head_dir(target_dir: Path, out: Path, *, seed: int = 0,
                         num_layers: int = 1, fc_bias: bool = True) -> Path:
    """A random EAGLE-1 head for the tiny model in ``target_dir``, saved as an EAGLE folder:
    ``config.json`` (the target's Llama config with ``num_layers`` layers) and
    ``model.safetensors`` with ``fc.weight`` (+ ``fc.bias``) and ``layers.N.*`` (layer 0
    without ``input_layernorm``, as EAGLE trains it), plus the target's embedding (EAGLE
    checkpoints carry it; llmkit shares the target's)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    target = AutoConfig.from_pretrained(str(target_dir))
    config = LlamaConfig(**{**target.to_dict(), "num_hidden_layers": num_layers,
                            "architectures": ["LlamaForCausalLM"]})
    torch.manual_seed(seed)
    h = config.hidden_size
    tensors: dict[str, torch.Tensor] = {"fc.weight": torch.randn(h, 2 * h) * (3.0 / h ** 0.5)}
    if fc_bias:
        tensors["fc.bias"] = torch.randn(h) * 0.05
    for i in range(num_layers):
        layer = LlamaDecoderLayer(config, i)
        for name, p in layer.state_dict().items():
            if i == 0 and name.startswith("input_layernorm"):
                continue
            t = p.detach().clone().float()
            t = t.uniform_(0.5, 1.5) if "norm" in name else t.normal_(0.0, 3.0 / h ** 0.5)
            tensors[f"layers.{i}.{name}"] = t.contiguous()
    tensors["embed_tokens.weight"] = load_file(str(target_dir / "model.safetensors"))[
        "model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"))
    return out


# Prompts for the successor model: ascending runs (it copies them), repeats, a shared prefix
# (prefix hits).
SUCCESSOR_PROMPTS = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 5, 9, 33, 40],
                     [5, 9, 33, 2, 71, 8] * 3, [17] * 20, [100, 200, 300, 100, 7, 8],
                     [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 5, 9, 120, 121, 122, 123, 124,
                      120]]


def build_successor_model_dir(out: Path, tokenizer, *, seed: int = 0,
                              layer_scale: float = 0.5) -> Path:
    """A tiny Llama whose greedy continuation counts up: the LM head is the embedding shifted by
    one (token x's embedding scores x + 1), its layers' outputs scaled by ``layer_scale`` so
    that they still move every logit (a wrong KV entry shows in the logprobs) without changing
    the argmax. Prompts with ascending runs make its outputs copy from its inputs (n-gram
    drafts get accepted where the run continues and rejected where the prompt's run ends)."""
    from transformers import AutoModelForCausalLM

    config = make_config("llama", tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            param.mul_(3.0)
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(torch.randn_like(emb), dim=1) * 8.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(torch.roll(emb, 1, dims=0))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
