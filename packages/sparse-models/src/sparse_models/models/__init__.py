"""Model families. Importing this package registers every built-in architecture."""

from sparse_models.models.deepseek import DeepseekForCausalLM
from sparse_models.models.llama import LlamaForCausalLM
from sparse_models.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["DeepseekForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
