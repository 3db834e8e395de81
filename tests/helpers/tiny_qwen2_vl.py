"""Tiny random Qwen2-VL and Qwen2.5-VL models (vision transformer, Qwen2 LM with M-RoPE) saved
as Hugging Face folders with their processor (``Qwen2VLImageProcessor`` with small
``min_pixels``/``max_pixels``, a tokenizer with the vision tokens), built with transformers so
that llmkit loads them like a real checkpoint and HF serves as the reference."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.tiny_models import BASE_CONFIG, build_tokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# An image in a prompt, as Qwen2-VL's chat template writes it.
IMAGE = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
PATCH_SIZE, MERGE_SIZE = 7, 2
# Images are resized to multiples of 14 pixels within these: 4 to 16 tokens each.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56

QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_qwen2_vl_tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD,
                                                          "<|video_pad|>"]})
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tok


def _vision_config(variant: str) -> dict:
    common = dict(depth=3, num_heads=4, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if variant == "qwen2_vl":
        return dict(common, embed_dim=32, hidden_size=BASE_CONFIG["hidden_size"], mlp_ratio=2,
                    hidden_act="quick_gelu")
    # Windows of 28 pixels: 2x2 merged tokens, smaller at the right and bottom edges; block 1
    # attends over the whole image.
    return dict(common, hidden_size=32, out_hidden_size=BASE_CONFIG["hidden_size"],
                intermediate_size=48, hidden_act="silu", window_size=28,
                fullatt_block_indexes=[1], tokens_per_second=2)


def build_qwen2_vl_dir(out: Path, *, variant: str = "qwen2_vl", seed: int = 0) -> Path:
    """Save a tiny random ``qwen2_vl`` or ``qwen2_5_vl`` (weights scaled by 3, as
    ``tiny_models.build_model_dir``), its tokenizer and image processor into ``out``."""
    import transformers

    tok = build_qwen2_vl_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", IMAGE_PAD), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END))}
    text = dict(hidden_size=BASE_CONFIG["hidden_size"], intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=len(tok),
                # head_dim 16: the 8 rotary frequencies split temporal 2, height 3, width 3
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    prefix = "Qwen2VL" if variant == "qwen2_vl" else "Qwen2_5_VL"
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=_vision_config(variant), tie_word_embeddings=False,
        **ids)
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif "visual" in name:
                param.normal_(0.0, 0.1)
            param.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    image_processor = _image_processor_class()(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2)
    image_processor.save_pretrained(str(out))
    return out


def _image_processor_class():
    """transformers' Qwen2-VL image processor on PIL (no torchvision needed)."""
    import transformers

    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or \
        transformers.Qwen2VLImageProcessor


def hf_processor(path: Path):
    """Hugging Face's ``Qwen2VLProcessor`` over the folder's tokenizer and image processor
    (images only: its video processor needs torchvision, which the tests do without)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor" or argument is not None:
                return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(str(path)),
                      tokenizer=AutoTokenizer.from_pretrained(str(path)),
                      chat_template=QWEN2_VL_CHAT_TEMPLATE)
