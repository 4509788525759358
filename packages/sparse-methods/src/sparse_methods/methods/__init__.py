"""The registered methods; importing this package registers them all."""

from sparse_methods.methods import (
    adakv,
    compressed_storage,
    dense,
    flashprefill,
    h2o,
    kvzip,
    omnikv,
    pyramidkv,
    quest,
    retroinfer,
    rkv,
    skipkv,
    snapkv,
    streamingllm,
    tova,
)

__all__ = [
    "adakv",
    "compressed_storage",
    "dense",
    "flashprefill",
    "h2o",
    "kvzip",
    "omnikv",
    "pyramidkv",
    "quest",
    "retroinfer",
    "rkv",
    "skipkv",
    "snapkv",
    "streamingllm",
    "tova",
]
