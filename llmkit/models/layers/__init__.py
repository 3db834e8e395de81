"""Building blocks of the model implementations, one concept per module."""
from llmkit.models.layers.activation import SiluAndMul
from llmkit.models.layers.embedding import VocabEmbedding
from llmkit.models.layers.linear import Linear, MergedLinear
from llmkit.models.layers.moe import FusedMoE
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = ["FusedMoE", "Linear", "MergedLinear", "RMSNorm", "RotaryEmbedding", "SiluAndMul",
           "VocabEmbedding", "apply_rotary", "compute_inv_freq"]
