"""Model families. Importing this package registers every built-in architecture."""

from sparse_models.models.deepseek import DeepseekForCausalLM
from sparse_models.models.gemma3 import Gemma3ForCausalLM
from sparse_models.models.llama import LlamaForCausalLM
from sparse_models.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["DeepseekForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
