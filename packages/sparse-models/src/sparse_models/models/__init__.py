"""Model families. Importing this package registers every built-in architecture."""

from sparse_models.models.deepseek import DeepseekForCausalLM
from sparse_models.models.llama import LlamaForCausalLM

__all__ = ["DeepseekForCausalLM", "LlamaForCausalLM"]
