"""Method-agnostic KV-cache structures: block pool, block tables and the radix prefix cache."""

from sparse_cache.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import BlockTable, LayerTables
from sparse_cache.kv_cache_manager import KVCacheManager, PrefixMatch

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockTable",
    "KVCacheManager",
    "LayerTables",
    "PrefixMatch",
    "hash_block",
    "hash_full_blocks",
    "root_hash",
]
