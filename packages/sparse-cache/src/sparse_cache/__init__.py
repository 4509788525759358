"""Method-agnostic KV-cache structures: block pool, block tables, the radix prefix cache, the chain
cache, prefix-cache pruning plans and the store kinds that describe a layer's KV storage."""

from sparse_cache.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import BlockTable, LayerTables, RequestTables
from sparse_cache.chain_cache import ChainCache, ChainCheckout, ChainInfo, ChainStatus
from sparse_cache.chain_errors import (
    ChainBusyError,
    ChainCapacityError,
    ChainError,
    ChainExistsError,
    ChainFingerprintError,
    ChainPrefixMismatchError,
    UnknownChainError,
)
from sparse_cache.kv_cache_manager import KVCacheManager, PrefixMatch
from sparse_cache.layer_layout import LayerLayout
from sparse_cache.pruning import PrunePlan, PruneRange, check_ranges, plan_prune
from sparse_cache.store_kind import (
    MODEL_DTYPE,
    SUMMARY_CODES,
    SUMMARY_TENSORS,
    StoreKind,
    TensorSpec,
    head_major_paged,
    latent_paged,
    paged,
    quantized_paged,
)
from sparse_cache.tail_rows import TailRows

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockTable",
    "ChainBusyError",
    "ChainCache",
    "ChainCapacityError",
    "ChainCheckout",
    "ChainError",
    "ChainExistsError",
    "ChainFingerprintError",
    "ChainInfo",
    "ChainPrefixMismatchError",
    "ChainStatus",
    "KVCacheManager",
    "MODEL_DTYPE",
    "SUMMARY_CODES",
    "SUMMARY_TENSORS",
    "LayerLayout",
    "LayerTables",
    "RequestTables",
    "PrefixMatch",
    "PrunePlan",
    "PruneRange",
    "StoreKind",
    "TailRows",
    "TensorSpec",
    "UnknownChainError",
    "check_ranges",
    "hash_block",
    "hash_full_blocks",
    "head_major_paged",
    "latent_paged",
    "paged",
    "plan_prune",
    "quantized_paged",
    "root_hash",
]
