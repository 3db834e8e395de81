"""A tiny random LLaVA (CLIP vision tower, MLP projector, Llama LM) saved as a Hugging Face
folder with its processor (image processor + tokenizer with an ``<image>`` token), built with
transformers so that llmkit loads it like a real checkpoint and HF serves as the reference."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.tiny_models import BASE_CONFIG, CHAT_TEMPLATE, build_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
PATCH_SIZE = 7
# (28 / 7)^2 patches, the CLS token dropped ("default" feature selection).
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

# Content parts: an image part becomes the placeholder, text parts their text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_llava_tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok


def build_llava_dir(out: Path, *, seed: int = 0, tower: str = "clip") -> Path:
    """Save a tiny random LLaVA (weights scaled by 3, as ``tiny_models.build_model_dir``),
    its tokenizer and a ``LlavaProcessor`` (CLIP image processor, 28x28 crops) into ``out``.
    ``tower="siglip"``: a SigLIP vision tower (its image processor resizes to 28x28; the
    ``full`` feature strategy: one token per patch, ``NUM_IMAGE_TOKENS`` again)."""
    import transformers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = build_llava_tokenizer()
    text = LlamaConfig(**BASE_CONFIG, num_hidden_layers=2, tie_word_embeddings=False,
                       vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision_args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    strategy = "default" if tower == "clip" else "full"
    if tower == "clip":
        vision = CLIPVisionConfig(**vision_args, projection_dim=32)
    else:
        vision = transformers.SiglipVisionConfig(**vision_args)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu")
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif "vision_tower" in name or "projector" in name:
                param.normal_(0.0, 0.1)
            param.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    if tower == "clip":
        image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={
            "height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        siglip = getattr(transformers, "SiglipImageProcessorPil", None) or \
            transformers.SiglipImageProcessor
        image_processor = siglip(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok,
                               patch_size=PATCH_SIZE, vision_feature_select_strategy=strategy,
                               num_additional_image_tokens=1 if tower == "clip" else 0,
                               image_token=IMAGE_TOKEN, chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    return out
