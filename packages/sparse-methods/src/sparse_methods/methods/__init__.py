"""The registered methods; importing this package registers them all."""

from sparse_methods.methods import dense, h2o, omnikv, pyramidkv, quest, snapkv, streamingllm

__all__ = ["dense", "h2o", "omnikv", "pyramidkv", "quest", "snapkv", "streamingllm"]
