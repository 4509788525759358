"""Building blocks shared by the model families, one concept per file."""

from sparse_models.layers.activation import SiluAndMul
from sparse_models.layers.embedding import LMHead, VocabEmbedding
from sparse_models.layers.linear import Linear, MergedLinear
from sparse_models.layers.norm import RMSNorm
from sparse_models.layers.rotary import RotaryEmbedding, apply_rotary, default_inv_freq, llama3_inv_freq

__all__ = [
    "LMHead",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary",
    "default_inv_freq",
    "llama3_inv_freq",
]
