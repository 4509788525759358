"""Model definitions, HF checkpoint loading and dummy weights for SparseEngine.

Import order matters only in that ``sparse_models.models`` registers the built-in families.
"""

from sparse_models.attention import AttentionBackend
from sparse_models.config import ModelConfig, RopeScaling, read_model_config
from sparse_models.contiguous_attention import ContiguousCausalAttention
from sparse_models.loader import load_model
from sparse_models.models import LlamaForCausalLM
from sparse_models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    register_model,
    supported_architectures,
)
from sparse_models.weights import CheckpointError

__all__ = [
    "AttentionBackend",
    "CheckpointError",
    "ContiguousCausalAttention",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "UnsupportedArchitectureError",
    "get_model_class",
    "load_model",
    "read_model_config",
    "register_model",
    "supported_architectures",
]
