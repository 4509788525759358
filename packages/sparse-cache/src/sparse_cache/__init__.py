"""Method-agnostic KV-cache structures: block pool, block tables, the radix prefix cache, the chain
cache and prefix-cache pruning plans."""

from sparse_cache.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import BlockTable, LayerTables
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
from sparse_cache.pruning import PrunePlan, PruneRange, check_ranges, plan_prune

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
    "LayerTables",
    "PrefixMatch",
    "PrunePlan",
    "PruneRange",
    "UnknownChainError",
    "check_ranges",
    "hash_block",
    "hash_full_blocks",
    "plan_prune",
    "root_hash",
]
