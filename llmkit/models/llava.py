"""LLaVA (``LlavaForConditionalGeneration``): a CLIP or SigLIP vision tower, a two-layer MLP
projector and a Llama-family language model.

The language model is ``LlamaForCausalLM`` itself, built from the config's ``text_config``
with the same ``ModelContext``: its forward (paged attention, platform ops, linear methods) is
the one every text model runs; LLaVA adds only what turns an image into the embeddings of its
placeholder tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.models.base import ModelContext
from llmkit.models.clip import CLIPVisionModel, num_layers_to_feature
from llmkit.models.siglip import SiglipVisionModel
from llmkit.models.vision_language import VisionLanguageModel

# vision_config.model_type -> tower class.
VISION_TOWERS = {"clip_vision_model": CLIPVisionModel, "siglip_vision_model": SiglipVisionModel}

PROJECTOR_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
                         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# Checkpoint name prefixes -> this model's: transformers < 4.52 saved
# ``language_model.model.*``; newer versions save ``model.language_model.*``.
_WEIGHT_PREFIXES = (
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if act not in PROJECTOR_ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {act!r} is not supported; supported: "
                             f"{', '.join(PROJECTOR_ACTIVATIONS)}")
        self.act = PROJECTOR_ACTIVATIONS[act]
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def llava_num_image_tokens(hf_config) -> int:
    """Placeholder tokens per image: one per patch (plus CLIP's CLS), less the first under the
    ``default`` strategy (which drops it: CLIP's CLS, SigLIP's first patch, as HF does)."""
    vc = hf_config.vision_config
    patches = (vc.image_size // vc.patch_size) ** 2
    cls = 1 if vc.model_type == "clip_vision_model" else 0
    return patches + cls - (1 if hf_config.vision_feature_select_strategy == "default" else 0)


class LlavaForConditionalGeneration(VisionLanguageModel):
    weight_prefixes = _WEIGHT_PREFIXES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        feature_layer = hf_config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ValueError(f"vision_feature_layer {feature_layer!r}: only one layer (an int) "
                             "is supported")
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             "(default, full)")
        vc, tc = hf_config.vision_config, hf_config.text_config
        if vc.model_type not in VISION_TOWERS:
            raise ValueError(f"LLaVA vision tower {vc.model_type!r} is not supported "
                             f"({', '.join(VISION_TOWERS)})")
        self.drop_cls = strategy == "default"
        self.image_token_id = int(getattr(hf_config, "image_token_id", None)
                                  if getattr(hf_config, "image_token_id", None) is not None
                                  else hf_config.image_token_index)
        # The vision tower is small next to the LM and runs once per image: plain torch
        # modules in the model's dtype rather than the platform's linear methods.
        self.vision_tower = VISION_TOWERS[vc.model_type](
            vc, num_layers_to_feature(vc, feature_layer), ctx.dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vc.hidden_size, tc.hidden_size, hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)), ctx.dtype)
        self._build_language_model(tc, ctx)
        self.num_image_tokens = llava_num_image_tokens(hf_config)

    def embed_multimodal(self, pixel_values: torch.Tensor,
                         grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        features = self.vision_tower(pixel_values.to(self.dtype))
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def _encoder_weight_name(self, name: str) -> str | None:
        if name.startswith("vision_tower."):
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            if _unused_vision_weight(name, len(self.vision_tower.encoder.layers)):
                return None
        return name


def _unused_vision_weight(name: str, num_layers: int) -> bool:
    """Layers past the feature layer, the final norm and SigLIP's pooling head, that the LM
    never reads."""
    if name.startswith(("vision_tower.post_layernorm.", "vision_tower.head.")):
        return True
    prefix = "vision_tower.encoder.layers."
    if name.startswith(prefix):
        return int(name[len(prefix):].split(".", 1)[0]) >= num_layers
    return False
