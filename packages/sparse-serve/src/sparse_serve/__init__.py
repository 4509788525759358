"""SparseEngine serving: the offline ``LLM`` API, engine, scheduler, runner and CLI."""

from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.llm import LLM
from sparse_serve.outputs import RequestOutput
from sparse_serve.prune import PruneError, PruneResult
from sparse_serve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "PruneError", "PruneResult", "RequestOutput", "SamplingParams"]
