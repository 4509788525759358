"""The registered methods; importing this package registers them all."""

from sparse_methods.methods import dense, h2o, pyramidkv, quest, snapkv, streamingllm

__all__ = ["dense", "h2o", "pyramidkv", "quest", "snapkv", "streamingllm"]
